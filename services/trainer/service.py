"""The trainer service: consume groups, step, publish weight versions, checkpoint, then acknowledge.

Staleness of a sample (one definition, used for filtering and metrics): the number of optimizer steps between
the weights the trainer computes the gradient with (its latest published version) and the weights that
produced the sample's oldest token, counted along the version lineage (relayrl.common.versions) so that it
stays right across a resume. Groups with a sample beyond ``rollout.max_staleness`` are dropped, recorded in
Redis and counted (``groups_dropped_stale``, ``episodes_dropped_stale``); nothing is dropped silently.

Reward errors (an episode whose reward status is ERROR or TIMEOUT: its verifier failed, so its reward means
nothing): with ``trainer.on_reward_error: drop`` such episodes are excluded from the loss and counted
(``episodes_dropped_reward_error``). The rest of their group is trained as a smaller group: advantages are
computed over its valid episodes only, since a failed score is no evidence about the sample. A group with no
valid episode is dropped like a stale one, recorded in Redis and counted (``groups_dropped_reward_error``).
With ``fail`` the trainer stops with an error naming the episode, before training its group. Groups produced =
trained + dropped as stale + dropped for reward errors + pending.

Ranks: every rank reads its own share of groups as the stable Redis consumer ``<consumer>-rank<r>``
(groups_per_step / world_size groups per step), gradients are all-reduced over the global batch (see
Learner.rl_gradients), and rank 0 alone allocates and publishes each weight version, serves the status
API, writes metrics and the model part of checkpoints.

Exactly-once effect: a group's stream entry is acknowledged only after a checkpoint that includes its effect
is durable. Each checkpoint records, per rank, the ids of the groups consumed (trained or dropped) since the
previous one. On restart each rank re-reads its own pending entries first, acknowledges (without training)
the groups the restored checkpoint already holds, trains the rest, then reads new entries. Pending entries
of consumers that no longer exist (a larger earlier world size) are claimed by rank 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist
from fastapi import FastAPI

from relayrl.client import InferenceClient
from relayrl.common.control import redacted, redacted_yaml, require_token
from relayrl.common.control_api import control_app
from relayrl.common.dataset import load_jsonl
from relayrl.common.grpc_utils import ServerHandle, create_server
from relayrl.common.logging import log_context
from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.pb import reward_pb2, trainer_pb2, trainer_pb2_grpc
from relayrl.common.pb.common_pb2 import GetConfigRequest, RunConfigText, ServingState
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.common.retry import redis_retry
from relayrl.common.service import StatusHeader
from relayrl.common.stream import EpisodeStream, StreamEntry
from relayrl.common.tracking import Tracker, open_tracker
from relayrl.common.versions import VersionLineage, VersionSource
from relayrl.config import RunConfig
from relayrl.config.trainer import RewardErrorPolicy
from relayrl.trainer.checkpoint import load_trainer_state, resume_point, save_checkpoint
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.learner import Learner, StepStats
from relayrl.trainer.metrics import trainer_metrics
from relayrl.trainer.weight_sync import PushResult, WeightPublisher

log = logging.getLogger(__name__)


def oldest_version(entry: StreamEntry) -> int:
    return min(min(ep.token_weight_versions, default=0) for ep in entry.group.episodes)


def reward_failed(ep: Episode) -> bool:
    """Whether scoring this episode failed. UNSPECIFIED (written before the field existed) reads as OK."""
    return ep.reward_status not in (reward_pb2.SCORE_STATUS_UNSPECIFIED, reward_pb2.SCORE_STATUS_OK)


class RewardErrorStop(RuntimeError):
    """An episode's scoring failed and ``trainer.on_reward_error`` is ``fail``."""


StalenessFn = Callable[[int], Awaitable[int]]  # token version -> optimizer steps behind the current weights


class GroupCollector:
    """Reads this rank's groups: pending ones first, skipping groups a checkpoint already holds, then new
    ones; drops (and counts) groups beyond the staleness bound."""

    def __init__(self, stream: EpisodeStream, consumer: str, max_staleness: int, block_ms: int,
                 already_done: set[str], retry_s: float = 60.0,
                 on_reward_error: RewardErrorPolicy = RewardErrorPolicy.DROP) -> None:
        self.retry_s = retry_s
        self.on_reward_error = on_reward_error
        self.seen: set[str] = set()  # group ids this incarnation took (ready, trained or dropped)
        self.stream = stream
        self.consumer = consumer
        self.max_staleness = max_staleness
        self.block_ms = block_ms
        self.already_done = already_done  # group ids whose effect the restored checkpoint holds
        self._ready: list[StreamEntry] = []
        self._pending_after: str | None = "0"  # page through our own pending entries first, then new ones
        self.consumed_ids: list[str] = []  # groups trained or dropped since the last checkpoint
        self.unacked: list[str] = []  # their stream entry ids (acknowledged after the next checkpoint)
        self.done_on_resume: list[str] = []  # entry ids of groups the restored checkpoint holds

    async def collect(self, num_groups: int, staleness: StalenessFn) -> list[StreamEntry]:
        while True:
            await self._drop_failed()
            await self._drop_stale(staleness)
            if len(self._ready) >= num_groups:
                taken, self._ready = self._ready[:num_groups], self._ready[num_groups:]
                return taken
            # read only the shortfall: a rank that took more than its share could starve the others
            count, after = num_groups - len(self._ready), self._pending_after
            entries = await redis_retry(
                lambda c=count, a=after: self.stream.read(self.consumer, count=c, block_ms=self.block_ms,  # type: ignore[misc]
                                                          pending_after=a),
                "read", self.retry_s, on_reconnect=self._rescan)
            if self._pending_after is not None and after == self._pending_after:
                self._pending_after = entries[-1].entry_id if entries else None
            waiting = {e.group.group_id for e in self._ready}
            for entry in entries:
                gid = entry.group.group_id
                if gid in waiting:
                    continue  # seen again by a rescan, still waiting to be trained
                if gid in self.already_done:
                    self.done_on_resume.append(entry.entry_id)  # its effect is in the checkpoint: no retraining
                elif gid in self.seen:
                    # trained or dropped already, delivered again (Redis lost a delivery or an ack in a crash):
                    # never train twice; acknowledge it with the next checkpoint
                    self.unacked.append(entry.entry_id)
                else:
                    self.seen.add(gid)
                    self._ready.append(entry)

    def _rescan(self) -> None:
        """After a Redis outage, page through our pending entries again: acks or deliveries may be lost."""
        self._pending_after = "0"

    async def _drop_failed(self) -> None:
        """Reward errors: stop (policy fail), or drop and count the groups with no valid episode (drop)."""
        keep: list[StreamEntry] = []
        for entry in self._ready:
            failed = [ep for ep in entry.group.episodes if reward_failed(ep)]
            if failed and self.on_reward_error is RewardErrorPolicy.FAIL:
                ep = failed[0]
                raise RewardErrorStop(
                    f"episode {ep.episode_id} of group {entry.group.group_id} has reward status "
                    f"{reward_pb2.ScoreStatus.Name(ep.reward_status)}: {ep.reward_error} "
                    f"({len(failed)} of {len(entry.group.episodes)} failed; trainer.on_reward_error is fail)")
            if failed and len(failed) == len(entry.group.episodes):
                await redis_retry(lambda e=entry: self.stream.record_dropped(  # type: ignore[misc]
                    e.group.group_id, len(e.group.episodes), "reward_error"), "record drop", self.retry_s)
                self.consumed(entry)
                log.warning("dropped group %s: every episode failed scoring (%s)", entry.group.group_id,
                            failed[0].reward_error)
            else:
                keep.append(entry)
        self._ready = keep

    async def _drop_stale(self, staleness: StalenessFn) -> None:
        keep: list[StreamEntry] = []
        for entry in self._ready:
            lag = await staleness(oldest_version(entry))
            if lag > self.max_staleness:
                with log_context(group_id=entry.group.group_id):
                    # recorded in Redis at once: rollout's admission releases it without waiting for a step
                    await redis_retry(lambda e=entry: self.stream.record_dropped(e.group.group_id,
                                                                                 len(e.group.episodes)),
                                      "record drop", self.retry_s)
                    self.consumed(entry)
                    log.warning("dropped group %s: staleness %d > max_staleness %d", entry.group.group_id, lag,
                                self.max_staleness)
            else:
                keep.append(entry)
        self._ready = keep

    def consumed(self, entry: StreamEntry) -> None:
        self.consumed_ids.append(entry.group.group_id)
        self.unacked.append(entry.entry_id)


class TrainerService:
    def __init__(self, cfg: RunConfig, collectives: Collectives | None = None) -> None:
        self.cfg = cfg
        tc = cfg.trainer
        self.coll = collectives or Collectives(None, tc.distributed.collective_timeout_s)
        self.rank = self.coll.rank
        self.is_main = self.rank == 0
        self.device = torch.device(cfg.model.device)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.resumed_from: Path | None = resume_point(cfg.checkpoint_dir, self.coll) \
            if tc.checkpoint.resume == "auto" else None
        # rank 0 restores the weights from the checkpoint; the others receive them by the initial broadcast
        model_path = self.resumed_from / "model" if self.resumed_from and self.is_main else None
        self.model = load_model(cfg.model, model_path)
        self.learner = Learner(self.model, tc, int(self.tokenizer.pad_token_id), self.device,
                               max_completion_tokens=cfg.rollout.max_new_tokens, collectives=self.coll)
        self.header = StatusHeader("trainer")
        self.step = 0
        self.weight_version = 0
        self.episodes_trained = 0
        self.groups_trained = 0
        self.finished = False
        self.publishing = False
        self.resumed_version = 0  # version of the restored weights, when resuming
        self._push_lock = asyncio.Lock()  # a publication and a re-push never interleave
        self._weights_lock = threading.Lock()  # a snapshot for publication never sees half an optimizer step
        self.publisher = WeightPublisher(
            self.model, self.device, cfg.inference.server.target, tc.publication.transport, cfg.weights_dir,
            tc.publication.chunk_bytes, tc.publication.push_timeout_s,
            WeightPublisher.default_probe(self.model, self.tokenizer, tc.publication.probe_sequences,
                                          tc.publication.probe_tokens, cfg.seed),
            tc.publication.probe_tolerance or None)
        self.last_push: PushResult | None = None
        self.checkpoint_requested = False  # rank 0, by the control plane; all ranks learn it with the next version
        self._checkpoint_now = False
        self.last_checkpoint_step = 0
        self.queue_depth: tuple[int | None, int] = (None, 0)  # (lag, pending) at the last step (rank 0)
        self.staleness_counts: dict[int, int] = {}  # samples trained per staleness (rank 0, global, for metrics)
        already_done: set[str] = set()
        counters: dict[str, Any] = {}
        if self.resumed_from is not None:
            state = load_trainer_state(self.resumed_from, self.learner.optimizer, self.coll)
            self.step, counters, already_done = state.step, state.extra, state.consumed_ids
            self.resumed_version = state.weight_version
            self.learner.steps_done = state.step
            log.info("resumed from %s at step %d (%d groups held by it)", self.resumed_from, self.step,
                     len(already_done))
        self.episodes_trained = int(counters.get("episodes_trained", 0))
        self.groups_trained = int(counters.get("groups_trained", 0))
        self.stream = EpisodeStream.from_url(cfg.redis.url, cfg.redis.stream, cfg.redis.group)
        self.versions = VersionSource(self.stream.client, cfg.redis.version_key)
        self.lineage_db = VersionLineage(self.stream.client, cfg.redis.version_key)
        self.lineage = 0  # set at the first publication (rank 0)
        self.consumer = f"{tc.stream.consumer}-rank{self.rank}"
        self.collector = GroupCollector(self.stream, self.consumer, cfg.rollout.max_staleness,
                                        tc.stream.read_block_ms, already_done, cfg.redis.retry_s, tc.on_reward_error)
        # drops over all ranks and restarts, from Redis (refreshed by rank 0 after each step)
        self.groups_dropped_stale = 0
        self.episodes_dropped_stale = 0
        self.groups_dropped_reward_error = 0  # whole groups, from Redis
        self.episodes_dropped_reward_error = 0  # their episodes + errored episodes of trained groups
        # errored episodes excluded from trained groups, over every rank (kept in checkpoints like the others)
        self.episodes_excluded_reward_error = int(counters.get("episodes_excluded_reward_error", 0))
        self._t0 = time.monotonic()
        self._last_step_t = self._t0
        # audit trail: which groups each step trained, per rank and incarnation (fault tests read it)
        self.incarnation = f"{int(time.time() * 1000)}-{self.rank}"
        (cfg.output_dir / "trained").mkdir(parents=True, exist_ok=True)
        self._trained_log = (cfg.output_dir / "trained" / f"rank{self.rank}.jsonl").open("a")
        # rank 0: metrics.jsonl and the configured tracking backends (a backend that cannot start fails here)
        self.tracker: Tracker | None = open_tracker(cfg.tracking, cfg.output_dir, cfg.name, redacted(cfg)) \
            if self.is_main else None

    # -- status and publication (rank 0) -------------------------------------------------------------------
    def status(self) -> trainer_pb2.TrainerStatus:
        return trainer_pb2.TrainerStatus(
            component=self.header.message(), step=self.step, weight_version=self.weight_version,
            episodes_trained=self.episodes_trained, episodes_dropped_stale=self.episodes_dropped_stale,
            groups_per_step=self.cfg.trainer.groups_per_step, finished=self.finished, publishing=self.publishing,
            groups_dropped_stale=self.groups_dropped_stale,
            groups_dropped_reward_error=self.groups_dropped_reward_error,
            episodes_dropped_reward_error=self.episodes_dropped_reward_error,
            checkpoint_pending=self.checkpoint_requested, last_checkpoint_step=self.last_checkpoint_step)

    async def refresh_drops(self) -> None:
        """Drop counts over every rank and restart, from Redis."""
        retry_s = self.cfg.redis.retry_s
        self.groups_dropped_stale, self.episodes_dropped_stale = await redis_retry(
            self.stream.dropped, "count drops", retry_s)
        groups, episodes = await redis_retry(lambda: self.stream.dropped("reward_error"), "count drops", retry_s)
        self.groups_dropped_reward_error = groups
        self.episodes_dropped_reward_error = episodes + self.episodes_excluded_reward_error

    async def publish(self, policy_step: int) -> int:
        """Rank 0 allocates a fresh version from the durable counter, records its lineage and policy step, and
        pushes the (full, replicated) weights; every rank learns the version by a broadcast from rank 0."""
        message = torch.zeros(2, dtype=torch.int64)  # [version, checkpoint requested by an operator]
        if self.is_main:
            self.publishing = True
            try:
                message[0] = await self._allocate_and_push(policy_step,
                                                           self.weight_version or await self._served_version())
            finally:
                self.publishing = False
            message[1] = int(self.checkpoint_requested)
        await asyncio.to_thread(self.coll.broadcast, message, 0, "published_version")
        self.weight_version = int(message[0])
        self._checkpoint_now = bool(message[1])  # every rank agrees to checkpoint after this step
        return self.weight_version

    async def watch_inference(self, interval_s: float = 2.0) -> None:
        """Rank 0: if inference serves an older version than the trainer's (it restarted from disk), push the
        current weights again under a fresh version of the same policy step, so it never serves old weights
        for long. Rank-local (no collective): other ranks measure staleness through the lineage, where the
        re-pushed version and the current one are the same step."""
        while True:
            await asyncio.sleep(interval_s)
            if self.weight_version == 0 or self.publishing:
                continue
            try:
                served = await self._served_version()
            except RuntimeError:
                continue
            if served >= self.weight_version or self.finished:
                continue
            log.warning("inference serves version %d, older than %d: pushing the current weights again",
                        served, self.weight_version)
            try:
                await self._allocate_and_push(self.step, self.weight_version)
            except RuntimeError as exc:  # inference went away again: try at the next tick
                log.warning("re-push failed: %s", exc)

    async def _allocate_and_push(self, policy_step: int, floor: int) -> int:
        """Rank 0: a fresh version above ``floor``, recorded with its lineage and policy step, then the push.
        Serialised: a step's publication and a watchdog re-push never interleave."""
        async with self._push_lock:
            retry_s = self.cfg.redis.retry_s
            version = await redis_retry(lambda: self.versions.allocate(floor=floor), "allocate version", retry_s)
            with log_context(weight_version=version):
                await redis_retry(lambda: self._register(version, policy_step), "register version", retry_s)
                await self.push_weights(version)
            return version

    async def _register(self, version: int, policy_step: int) -> None:
        if self.lineage == 0:  # first publication of this incarnation: a new lineage, forked at resume
            self.lineage = version
            parent = 0
            if self.resumed_version:
                info = await self.lineage_db.info(self.resumed_version)
                parent = info.lineage if info is not None else 0
            await self.lineage_db.register_lineage(self.lineage, parent, self.step)
        await self.lineage_db.register(version, self.lineage, policy_step)

    async def staleness(self, token_version: int) -> int:
        """Optimizer steps between the current weights and those that produced ``token_version``."""
        return await redis_retry(lambda: self.lineage_db.distance(self.weight_version, token_version), "staleness",
                                 self.cfg.redis.retry_s)

    async def _served_version(self) -> int:
        """The version inference serves now (a floor for the first allocation after a restart)."""
        async with InferenceClient(self.cfg.inference.server.target, timeout_s=10.0, retries=4,
                                   backoff_s=0.5) as inference:
            try:
                return int((await inference.status()).weight_version)
            except grpc.aio.AioRpcError as exc:
                raise RuntimeError(f"inference status unavailable: {exc.code().name}") from exc

    async def push_weights(self, version: int) -> None:
        """Send the current weights as ``version`` and verify them (raises WeightVerificationError)."""
        params = await asyncio.to_thread(self._snapshot)
        result = await self.publisher.push(params, version)
        self.last_push = result
        log.info("published weight version %d (%d bytes by %s, %.3fs, probe max |Δ logprob| %.2e)", version,
                 result.bytes_sent, self.publisher.transport.value, result.seconds, result.probe_max_diff)

    def _snapshot(self) -> dict[str, torch.Tensor]:
        with self._weights_lock:  # never a half-updated model
            return self.publisher.snapshot()

    def _locked(self, step: Callable[..., StepStats], *args: Any) -> StepStats:
        with self._weights_lock:  # an optimizer step never overlaps a snapshot for publication
            return step(*args)

    def _write_metrics(self, row: dict[str, Any], step: int) -> None:
        """Rank 0: one row to metrics.jsonl and the tracking backends, ``step`` as its x-axis."""
        if self.tracker is not None:
            self.tracker.log(row, step)

    # -- training ------------------------------------------------------------------------------------------
    async def sft_warmup(self) -> None:
        tc = self.cfg.trainer
        rows = load_jsonl(self.cfg.rollout.dataset)
        eos = int(self.tokenizer.eos_token_id)
        enc = [(self.tokenizer(r.prompt, add_special_tokens=False)["input_ids"],
                [*self.tokenizer(r.answer, add_special_tokens=False)["input_ids"], eos]) for r in rows]
        gen = torch.Generator().manual_seed(self.cfg.seed * 1000 + self.rank)
        per_rank = max(1, tc.sft.batch_size // self.coll.world_size)
        for i in range(1, tc.sft.warmup_steps + 1):
            idx = torch.randint(len(enc), (per_rank,), generator=gen).tolist()
            stats = await asyncio.to_thread(self._locked, self.learner.sft_step, [enc[j][0] for j in idx],
                                            [enc[j][1] for j in idx])
            self._write_metrics({"phase": "sft", "sft_step": i, "loss": stats.loss, "grad_norm": stats.grad_norm,
                                 "time_s": time.monotonic() - self._t0}, i)
        log.info("supervised warm-up done (%d steps)", tc.sft.warmup_steps)
        await self.publish(self.step)

    async def train(self) -> None:
        tc = self.cfg.trainer
        await self.stream.ensure_group()
        if self.is_main:
            live = {f"{tc.stream.consumer}-rank{r}" for r in range(self.coll.world_size)}
            await self.stream.claim_from_gone_consumers(self.consumer, live)
        # identical starting weights on every rank, whatever each loaded
        await asyncio.to_thread(self.coll.broadcast_coalesced, list(self.model.parameters()), 0, "initial_weights")
        # The weights we start from get a fresh version too: inference and trainer agree on what is served,
        # and a restarted trainer never reuses a version.
        await self.publish(self.step)
        if tc.sft.warmup_steps > 0 and self.resumed_from is None:
            await self.sft_warmup()
        self.header.state = ServingState.SERVING_STATE_SERVING
        per_rank = tc.groups_per_step // self.coll.world_size
        while self.step < tc.total_steps:
            entries = await self.collector.collect(per_rank, self.staleness)
            # errored episodes never reach the loss; their groups train on the valid ones (see the docstring)
            episodes = [ep for e in entries for ep in e.group.episodes if not reward_failed(ep)]
            excluded = sum(len(e.group.episodes) for e in entries) - len(episodes)
            staleness = torch.tensor([await self.staleness(min(ep.token_weight_versions, default=0))
                                      for ep in episodes], dtype=torch.float32)
            t_step = time.monotonic()
            stats = await asyncio.to_thread(self._locked, self.learner.rl_step, episodes)
            for entry in entries:
                self.collector.consumed(entry)
                with log_context(group_id=entry.group.group_id):
                    log.debug("trained group at step %d (%d episodes: %s)", self.step + 1,
                              len(entry.group.episodes), ", ".join(ep.episode_id for ep in entry.group.episodes))
            self._trained_log.write(json.dumps({
                "incarnation": self.incarnation, "step": self.step + 1,
                "resumed_from_step": int(self.resumed_from.name.split("_")[1]) if self.resumed_from else 0,
                "groups": [[e.group.group_id, e.group.prompt_seq] for e in entries]}) + "\n")
            self._trained_log.flush()
            await self.publish(self.step + 1)
            self.step += 1
            summary = await asyncio.to_thread(self._global_summary, episodes, staleness, excluded)
            self.episodes_trained += int(summary["episodes"])
            self.episodes_excluded_reward_error += int(summary["reward_errors"])
            self.groups_trained += tc.groups_per_step
            if self.is_main:
                await self.refresh_drops()
            await self._log_step(summary, episodes, stats, time.monotonic() - t_step)
            due = bool(tc.checkpoint.every) and self.step % tc.checkpoint.every == 0
            if (due or self._checkpoint_now) and self.step < tc.total_steps:
                await self.checkpoint_and_ack()
        await self.checkpoint_and_ack()
        self.finished = True
        self.header.state = ServingState.SERVING_STATE_STOPPED

    def _global_summary(self, episodes: list[Episode], staleness: torch.Tensor, excluded: int = 0) -> dict[str, Any]:
        """Step statistics over every rank's episodes (SUM and MAX all-reduces of fixed-size vectors)."""
        s = self.cfg.rollout.max_staleness
        hist = torch.bincount(staleness.long().clamp(0, s + 1), minlength=s + 2).to(torch.float64)
        rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float64)
        lengths = sum(len(ep.completion_token_ids) for ep in episodes)
        sums = torch.cat([torch.tensor([float(len(episodes)), float(rewards.sum()), float((rewards ** 2).sum()),
                                        float(staleness.sum()), float(lengths), float(excluded)], dtype=torch.float64),
                          hist])
        self.coll.all_reduce(sums, dist.ReduceOp.SUM, "step_stats")
        maxima = torch.tensor([float(staleness.max()) if len(staleness) else 0.0], dtype=torch.float64)
        self.coll.all_reduce(maxima, dist.ReduceOp.MAX, "step_stats_max")
        n = max(float(sums[0]), 1.0)
        mean = float(sums[1]) / n
        return {"episodes": int(sums[0]), "reward_mean": mean,
                "reward_std": max(float(sums[2]) / n - mean * mean, 0.0) ** 0.5,
                "staleness_mean": float(sums[3]) / n, "staleness_max": int(maxima[0]),
                "completion_len_mean": float(sums[4]) / n, "reward_errors": int(sums[5]),
                "staleness_hist": {str(lag): int(c) for lag, c in enumerate(sums[6:].tolist()) if c}}

    async def checkpoint_and_ack(self) -> None:
        """Save a checkpoint (atomic), and only once it is durable acknowledge the groups it holds."""
        extra = {"episodes_trained": self.episodes_trained, "groups_trained": self.groups_trained,
                 "episodes_excluded_reward_error": self.episodes_excluded_reward_error}
        await asyncio.to_thread(
            save_checkpoint, self.cfg.checkpoint_dir, self.step, self.weight_version, self.model, self.tokenizer,
            self.learner.optimizer, self.cfg.trainer.checkpoint.keep, extra, self.coll,
            self.collector.consumed_ids)
        ids = self.collector.unacked + self.collector.done_on_resume
        acked = await redis_retry(lambda: self.stream.ack(ids), "ack", self.cfg.redis.retry_s)
        log.info("checkpoint at step %d durable; acknowledged %d groups", self.step, acked)
        self.last_checkpoint_step = self.step
        if self._checkpoint_now:  # the operator's request (broadcast with this step's version) is served
            self.checkpoint_requested = self._checkpoint_now = False
        self.collector.consumed_ids, self.collector.unacked, self.collector.done_on_resume = [], [], []

    async def _log_step(self, summary: dict[str, Any], episodes: list[Episode], stats: StepStats,
                        step_s: float) -> None:
        if not self.is_main:
            return
        now = time.monotonic()
        queue_lag, queue_pending = await redis_retry(self.stream.queue_depth, "queue depth", self.cfg.redis.retry_s)
        self.queue_depth = (queue_lag, queue_pending)
        components: dict[str, list[float]] = {}
        for ep in episodes:  # components of rank 0's share (names may differ between ranks)
            for k, v in ep.reward_components.items():
                components.setdefault(k, []).append(v)
        row = {
            "step": self.step, "weight_version": self.weight_version,
            "reward_mean": summary["reward_mean"], "reward_std": summary["reward_std"],
            **{f"reward/{k}": sum(v) / len(v) for k, v in sorted(components.items())},
            "episodes": summary["episodes"], "tokens": stats.tokens,
            "staleness_mean": summary["staleness_mean"], "staleness_max": summary["staleness_max"],
            "staleness_hist": summary["staleness_hist"],
            "episodes_dropped_stale": self.episodes_dropped_stale,
            "groups_dropped_stale": self.groups_dropped_stale,
            "reward_errors": summary["reward_errors"],
            "episodes_dropped_reward_error": self.episodes_dropped_reward_error,
            "groups_dropped_reward_error": self.groups_dropped_reward_error,
            "episodes_trained": self.episodes_trained, "groups_trained": self.groups_trained,
            "loss": stats.loss, "grad_norm": stats.grad_norm, "clip_frac": stats.clip_frac,
            "ratio_mean": stats.ratio_mean, "kl": stats.kl, "lr": stats.lr,
            "importance_mean": stats.importance_mean, "importance_max": stats.importance_max,
            "logprob_diff_mean": stats.logprob_diff_mean,
            "completion_len_mean": summary["completion_len_mean"],
            "episodes_per_s": summary["episodes"] / max(now - self._last_step_t, 1e-9),
            "step_time_s": step_s, "time_s": now - self._t0, "world_size": self.coll.world_size,
            "queue_lag": queue_lag, "queue_pending": queue_pending,
        }
        if self.last_push is not None:
            row |= {"weight_sync_s": self.last_push.seconds, "weight_sync_bytes": self.last_push.bytes_sent,
                    "probe_max_diff": self.last_push.probe_max_diff}
        self._last_step_t = now
        for lag, count in summary["staleness_hist"].items():
            self.staleness_counts[int(lag)] = self.staleness_counts.get(int(lag), 0) + count
        self._write_metrics(row, self.step)
        with log_context(weight_version=self.weight_version):
            log.info("step %d version %d reward %.3f staleness max %d loss %.4f", self.step, self.weight_version,
                     row["reward_mean"], row["staleness_max"], stats.loss)

    async def close(self) -> None:
        self._trained_log.close()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        await self.stream.close()
        self.coll.close()


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, service: TrainerService) -> None:
        self.service = service
        self.token = service.cfg.control.effective_token()

    async def request_checkpoint(self, reason: str = "") -> trainer_pb2.CheckpointReply:
        service = self.service
        if not service.checkpoint_requested:
            log.info("checkpoint requested after step %d%s", service.step + 1, f" ({reason})" if reason else "")
        service.checkpoint_requested = True
        return trainer_pb2.CheckpointReply(after_step=service.step + 1)

    async def RequestCheckpoint(self, request: trainer_pb2.CheckpointRequest,
                                context: grpc.aio.ServicerContext) -> trainer_pb2.CheckpointReply:
        await require_token(context, self.token)
        return await self.request_checkpoint(request.reason)

    async def GetConfig(self, request: GetConfigRequest, context: grpc.aio.ServicerContext) -> RunConfigText:
        return RunConfigText(yaml=redacted_yaml(self.service.cfg))

    def http_app(self) -> FastAPI:
        service = self.service
        return control_app("trainer", service.status, lambda: redacted_yaml(service.cfg), self.token,
                           trainer_metrics(service), {"/checkpoint": self.request_checkpoint})

    async def GetStatus(self, request: trainer_pb2.GetTrainerStatusRequest,
                        context: grpc.aio.ServicerContext) -> trainer_pb2.TrainerStatus:
        # drops are read live: a group dropped by any rank releases rollout's admission at once
        await self.service.refresh_drops()
        return self.service.status()


def create_trainer_server(service: TrainerService) -> tuple[ServerHandle, TrainerServicer]:
    tc = service.cfg.trainer
    servicer = TrainerServicer(service)
    handle = create_server(
        tc.server, [lambda s: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, s)],
        [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name])
    return handle, servicer
