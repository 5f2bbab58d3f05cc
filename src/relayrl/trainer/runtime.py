"""The trainer's parts, built from the run config and wired together (one per rank).

- :class:`~relayrl.trainer.groups.GroupCollector` reads this rank's groups and drops those it cannot train;
- :class:`~relayrl.trainer.loop.TrainingLoop` steps, publishes, logs and checkpoints;
- :class:`~relayrl.trainer.publication.VersionPublication` allocates and publishes weight versions (rank 0) and
  :func:`~relayrl.trainer.served.watch_inference` re-pushes them to a restarted inference;
- :class:`~relayrl.trainer.checkpoint_ack.CheckpointAck` saves checkpoints, then acknowledges their groups;
- :class:`~relayrl.trainer.progress.TrainerProgress` holds the counters that status and metrics read.
The gRPC and REST servicer of rank 0 is relayrl.trainer.server; relayrl.trainer.main starts it all.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from relayrl.client import InferenceClient
from relayrl.common import books
from relayrl.common.control import redacted
from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.pb import trainer_pb2
from relayrl.common.retry import OomBackpressure
from relayrl.common.service import StatusHeader
from relayrl.common.stream import EpisodeStream
from relayrl.config import RunConfig
from relayrl.config.publication import WeightTransport
from relayrl.config.trainer import MicroBatchLayout
from relayrl.config.typed import ConfigError
from relayrl.trainer.batching import packing_error
from relayrl.trainer.checkpoint import check_shared_folder, load_trainer_state, resume_point
from relayrl.trainer.checkpoint_ack import CheckpointAck
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.cores import CoreLoan, watch_inference_idle
from relayrl.trainer.dcp_checkpoint import load_state
from relayrl.trainer.groups import EntryChecks, GroupCollector, consumer_name
from relayrl.trainer.learner import Learner
from relayrl.trainer.loop import TrainingLoop
from relayrl.trainer.lora import load_policy
from relayrl.trainer.parallel_dims import ParallelDims, apply_fsdp, is_sharded
from relayrl.trainer.parts import LoopParts
from relayrl.trainer.progress import TrainerProgress
from relayrl.trainer.publication import VersionPublication
from relayrl.trainer.reference import Reference
from relayrl.trainer.served import watch_inference
from relayrl.trainer.teacher import Teacher
from relayrl.trainer.tracking import Tracker, open_tracker
from relayrl.trainer.transports import collective_host, make_transport, resolve_transport
from relayrl.trainer.versions import VersionLineage, VersionSource
from relayrl.trainer.weight_sync import WeightPublisher

log = logging.getLogger(__name__)


PACKING_TOLERANCE = 1e-2  # far above float32/bf16 rounding of the same attention, far below cross-attention


def check_packing(model: object, device: torch.device) -> None:
    """Refuse packed micro-batches for a model that would let packed sequences attend to each other."""
    error = packing_error(model, device)
    if error > PACKING_TOLERANCE:
        raise ConfigError(
            "trainer.micro_batch_layout",
            "packed",
            f"{type(model).__name__} does not keep sequences packed in one row apart (logprobs move by "
            f"{error:.3g} when packed); use padded",
        )
    log.info(
        "packed micro-batches: %s keeps packed sequences apart (max logprob difference %.2g)",
        type(model).__name__,
        error,
    )


class Trainer:
    def __init__(self, cfg: RunConfig, collectives: Collectives | None = None) -> None:
        self.cfg = cfg
        tc = cfg.trainer
        self.coll = collectives or Collectives(None, tc.distributed.collective_timeout_s)
        self.rank = self.coll.rank
        self.device = torch.device(cfg.model.device)
        self.tokenizer = load_tokenizer(cfg.model.path)
        if tc.distributed.dp_shard > 1 and self.coll.world_size > 1:
            check_shared_folder(cfg.checkpoint_dir, self.coll, tc.distributed.dp_shard)
        self.resumed_from: Path | None = (
            resume_point(cfg.checkpoint_dir, self.coll) if tc.checkpoint.resume == "auto" else None
        )
        dims = ParallelDims.from_config(tc.distributed, self.coll.world_size)
        self.model, self.plain_model = self._load_models(dims)
        # the KL term's frozen reference: the initial weights from model.path on every rank (also after a resume)
        reference = Reference(load_model(cfg.model)) if tc.loss.kl_coef > 0 and not tc.loss.reference_address else None
        self.learner = Learner(
            self.model,
            tc,
            int(self.tokenizer.pad_token_id),
            self.device,
            max_completion_tokens=cfg.rollout.episode_token_cap(),
            collectives=self.coll,
            reference=reference,
        )
        if tc.micro_batch_layout is MicroBatchLayout.PACKED:
            check_packing(self.model, self.device)
        self.cores = CoreLoan.of(tc.threads)  # generation's cores, borrowed while inference is idle
        if self.cores is not None:
            layers = self.cores.hook(self.model)
            log.info("borrows CPUs %s while inference is idle (switching at %d layers)", tc.threads.borrow_cpus, layers)
        self.header = StatusHeader("trainer")
        self.progress = TrainerProgress()
        already_done, resumed_version = self._restore()
        self.stream = EpisodeStream.from_config(cfg.redis, cfg.name)
        # every write of this rank to a full Redis waits and retries (up to redis.retry_s), counted here
        self.redis_backpressure = OomBackpressure("trainer")
        self.collector = self._collector(already_done)
        self.publication = self._publication(dims, resumed_version)
        self.publication.on_change = self.progress.changed.notify
        self.checkpoints = CheckpointAck(
            cfg.checkpoint_dir,
            tc.checkpoint.every,
            tc.checkpoint.keep,
            self.model,
            self.tokenizer,
            self.learner.optimizer,
            self.coll,
            self.collector,
            self.stream,
            cfg.redis.retry_s,
            self.plain_model,
            self.redis_backpressure,
        )
        self.checkpoints.last_step = self.progress.step  # the checkpoint resumed from (0: none)
        # rank 0: metrics.jsonl and the configured tracking backends (a backend that cannot start fails here)
        self.tracker: Tracker | None = (
            open_tracker(cfg.tracking, cfg.output_dir, cfg.name, redacted(cfg)) if self.rank == 0 else None
        )
        self.teacher, self.reference_scorer = self._scorers()
        self.loop = TrainingLoop(
            LoopParts(
                cfg,
                self.learner,
                self.tokenizer,
                self.coll,
                self.stream,
                self.collector,
                self.publication,
                self.checkpoints,
                self.progress,
                self.header,
                self.tracker,
                self.resumed_from,
                self.teacher,
                self.reference_scorer,
            )
        )

    def _publication(self, dims: ParallelDims, resumed_version: int) -> VersionPublication:
        """Allocating, pushing and verifying weight versions (relayrl.trainer.publication)."""
        cfg = self.cfg
        return VersionPublication(
            self._publisher(),
            VersionSource(self.stream.client, self.stream.keys),
            VersionLineage(self.stream.client, self.stream.keys),
            self.coll,
            [e.address for e in cfg.inference.replica_endpoints()],
            cfg.redis.retry_s,
            resumed_version,
            cfg.tls,
            sharded=dims.fsdp,
            inference_wait_s=cfg.trainer.publication.inference_wait_s,
            backpressure=self.redis_backpressure,
        )

    def _scorers(self) -> tuple[Teacher | None, Teacher | None]:
        """The teacher of on-policy distillation, and the reference served by an endpoint (the same scoring call as
        the teacher's), where configured."""
        cfg, tc = self.cfg, self.cfg.trainer
        teacher = Teacher(tc.teacher, cfg.tls) if tc.teacher.address else None
        reference = (
            Teacher(replace(tc.teacher, address=tc.loss.reference_address), cfg.tls)
            if tc.loss.kl_coef > 0 and tc.loss.reference_address
            else None
        )
        return teacher, reference

    def _load_models(self, dims: ParallelDims) -> tuple[Any, Any]:
        """The policy (base + LoRA adapter when model.lora.enabled; sharded under FSDP2) and, on rank 0 of a
        sharded trainer, an unsharded copy (it scores the probe and writes the Hugging Face export)."""
        cfg = self.cfg
        # rank 0 restores the weights from the checkpoint; the others receive them by the initial broadcast
        model_path = self.resumed_from / "model" if self.resumed_from and self.rank == 0 else None
        model = load_policy(cfg.model, model_path)
        plain_model = load_model(cfg.model) if dims.fsdp and self.rank == 0 else None
        if dims.fsdp:  # identical weights on every rank before sharding (the initial broadcast, done here)
            self.coll.broadcast_coalesced(list(model.parameters()), 0, "initial_weights")
            dc = cfg.trainer.distributed
            model = apply_fsdp(model, dims.build_mesh(self.device.type), dc.param_dtype, dc.reduce_dtype)
        return model, plain_model

    def _collector(self, already_done: set[str]) -> GroupCollector:
        """This rank's reader of its groups (relayrl.trainer.groups), checking entries against the model."""
        cfg, tc = self.cfg, self.cfg.trainer
        checks = EntryChecks(
            int(self.model.get_input_embeddings().num_embeddings),
            cfg.rollout.episode_token_cap(),
            VersionSource(self.stream.client, self.stream.keys).latest,
            tc.stream.dead_letter_maxlen,
        )
        return GroupCollector(
            self.stream,
            consumer_name(tc.stream.consumer, self.rank),
            cfg.rollout.max_staleness,
            tc.stream.read_block_ms,
            already_done,
            checks,
            cfg.redis.retry_s,
            tc.on_reward_error,
            tc.dynamic_sampling.max_drop_ratio if tc.dynamic_sampling.enabled else None,
            self.redis_backpressure,
        )

    def _restore(self) -> tuple[set[str], int]:
        """Counters, optimizer and step from the checkpoint resumed from: (groups it holds, its weight version)."""
        if self.resumed_from is None:
            return set(), 0
        # rank 0 tells whether the checkpoint is sharded: every rank then takes the same path (and collectives)
        dcp = self.coll.broadcast_object(
            (self.resumed_from / "dcp").is_dir() if self.rank == 0 else None, 0, "resume_dcp"
        )
        if is_sharded(self.model) or dcp:
            # a sharded checkpoint: every rank reads its part of model and optimizer (any sharding, any world size)
            if not dcp:
                raise RuntimeError(
                    f"{self.resumed_from} has no dcp/ folder: a sharded trainer (dp_shard > 1) resumes "
                    "only from checkpoints of a sharded one"
                )
            load_state(self.resumed_from / "dcp", self.model, self.learner.optimizer)
        state = load_trainer_state(self.resumed_from, self.learner.optimizer, self.coll)
        self.progress.restore(state.step, state.extra)
        self.learner.steps_done = state.step
        log.info(
            "resumed from %s at step %d (%d groups held by it)", self.resumed_from, state.step, len(state.consumed_ids)
        )
        return state.consumed_ids, state.weight_version

    def _publisher(self) -> WeightPublisher:
        pc, cfg = self.cfg.trainer.publication, self.cfg
        probe = WeightPublisher.default_probe(self.model, self.tokenizer, pc.probe_sequences, pc.probe_tokens, cfg.seed)
        endpoints = cfg.inference.replica_endpoints()
        # each replica's transport (its own, else the publication's), one instance per kind for all its replicas
        kinds = {e.weights_address: resolve_transport(e.transport or pc.transport) for e in endpoints}
        own = resolve_transport(pc.transport)
        host = collective_host(pc, WeightTransport.COLLECTIVE in kinds.values())
        made = {
            k: make_transport(k, pc.chunk_bytes, cfg.weights_dir, host, self.device) for k in {own, *kinds.values()}
        }
        publisher = WeightPublisher(
            self.model,
            self.device,
            list(kinds),
            made[own],
            pc.push_timeout_s,
            probe,
            pc.probe_tolerance or None,
            token=cfg.control.effective_weights_token(),
            tls=cfg.tls,
            plain_model=self.plain_model,
            probe_every=pc.probe_every,
        )
        publisher.transports = {target: made[kind] for target, kind in kinds.items()}  # each replica by its own
        return publisher

    async def train(self) -> None:
        await self.loop.train()

    async def publish(self, policy_step: int) -> int:
        return await self.loop.publish(policy_step)

    async def watch_inference(self, interval_s: float = 2.0) -> None:
        """Rank 0: re-push the current weights to an inference that serves older ones (see publication)."""
        await watch_inference(self.publication, lambda: self.progress.step, lambda: self.progress.finished, interval_s)

    async def borrow_idle_cores(self) -> None:
        """Rank 0 with trainer.threads.borrow_cpus: follow inference's load (relayrl.trainer.cores)."""
        if self.cores is None:
            return
        cfg = self.cfg
        async with InferenceClient(cfg.inference.server.target, timeout_s=2.0, retries=0, tls=cfg.tls) as inference:
            threads = cfg.trainer.threads
            await watch_inference_idle(
                self.cores,
                inference.status,
                threads.borrow_poll_s,
                lambda: self.progress.finished,
                lambda: self.loop.compute_s >= threads.borrow_min_compute_s,
            )

    def request_checkpoint(self) -> int:
        """Rank 0: checkpoint after the next step (every rank learns it with that step's version)."""
        self.checkpoints.requested = True
        return self.progress.step + 1

    async def refresh_drops(self) -> None:
        await self.progress.refresh_drops(self.stream, self.cfg.redis.retry_s)

    def status(self) -> trainer_pb2.TrainerStatus:
        p = self.progress
        return trainer_pb2.TrainerStatus(
            component=self.header.message(),
            step=self.publication.admission_step(p.step),
            weight_version=self.publication.weight_version,
            **books.values(p),  # every counter of the run's books (relayrl.common.books)
            groups_per_step=self.cfg.trainer.groups_per_step,
            finished=p.finished,
            publishing=self.publication.publishing,
            checkpoint_pending=self.checkpoints.requested,
            last_checkpoint_step=self.checkpoints.last_step,
            inference_replicas_behind=self.publication.replicas_behind(),
            weight_push_failures=self.publication.push_failures(),
        )

    async def close(self) -> None:
        if self.cores is not None:
            log.info("borrowed generation's CPUs %d times, for %.1fs", self.cores.borrows, self.cores.held_s())
        await self.publication.abandon()  # a push still in flight after an error or a stop
        self.loop.close()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = self.loop.tracker = None
        await self.stream.close()
        for scorer in (self.teacher, self.reference_scorer):
            if scorer is not None:
                await scorer.close()
        self.coll.close()
