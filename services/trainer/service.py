"""The trainer service: consume episodes, step, publish weight versions, acknowledge, log metrics.

Staleness of a sample (one definition, used for filtering and metrics): the trainer's current weight
version when it computes the gradient (the latest version it has published) minus the oldest weight
version among the sample's tokens. Groups with a sample beyond ``rollout.max_staleness`` are dropped,
acknowledged and counted in ``episodes_dropped_stale``; nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from relayrl.common.grpc_utils import ServerHandle, create_server, insecure_channel
from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.pb import inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from relayrl.common.pb.common_pb2 import ServingState
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.common.pb.inference_pb2 import WeightUpdateMessage
from relayrl.common.service import StatusHeader
from relayrl.common.stream import EpisodeStream, StreamEntry
from relayrl.common.versions import VersionSource
from relayrl.common.weights import iter_update_messages, model_tensors
from relayrl.config import RunConfig
from relayrl.rollout.dataset import load_jsonl
from relayrl.trainer.checkpoint import save_checkpoint
from relayrl.trainer.learner import Learner, StepStats

log = logging.getLogger(__name__)


@dataclass
class Group:
    group_id: str
    entries: list[StreamEntry] = field(default_factory=list)

    @property
    def episodes(self) -> list[Episode]:
        return [e.episode for e in self.entries]

    def oldest_version(self) -> int:
        return min(min(ep.token_weight_versions, default=0) for ep in self.episodes)


class GroupCollector:
    """Reads the stream and assembles complete groups; drops (acks and counts) groups beyond the bound."""

    def __init__(self, stream: EpisodeStream, consumer: str, max_staleness: int, block_ms: int) -> None:
        self.stream = stream
        self.consumer = consumer
        self.max_staleness = max_staleness
        self.block_ms = block_ms
        self._partial: dict[str, Group] = {}
        self._ready: list[Group] = []
        self._seen: set[str] = set()
        self._read_pending = True
        self._unacked: list[str] = []  # stale drops and duplicates: acknowledged with the next step
        self.episodes_dropped_stale = 0
        self.episodes_duplicate = 0

    async def collect(self, num_groups: int, current_version: int) -> list[Group]:
        while True:
            self._drop_stale(current_version)
            if len(self._ready) >= num_groups:
                taken, self._ready = self._ready[:num_groups], self._ready[num_groups:]
                return taken
            entries = await self.stream.read(self.consumer, count=256, block_ms=self.block_ms,
                                             pending=self._read_pending)
            if self._read_pending and not entries:
                self._read_pending = False  # own pending entries consumed: switch to new ones
            for entry in entries:
                self._add(entry)

    def _add(self, entry: StreamEntry) -> None:
        ep = entry.episode
        if ep.episode_id in self._seen:
            self.episodes_duplicate += 1
            self._unacked.append(entry.entry_id)
            return
        self._seen.add(ep.episode_id)
        group = self._partial.setdefault(ep.group_id, Group(ep.group_id))
        group.entries.append(entry)
        if len(group.entries) >= max(1, ep.group_size):
            self._ready.append(self._partial.pop(ep.group_id))

    def _drop_stale(self, current_version: int) -> None:
        keep: list[Group] = []
        drop: list[Group] = []
        for g in self._ready:
            (drop if current_version - g.oldest_version() > self.max_staleness else keep).append(g)
        self._ready = keep
        self._unacked.extend(e.entry_id for g in drop for e in g.entries)
        if drop:
            n = sum(len(g.entries) for g in drop)
            self.episodes_dropped_stale += n
            log.warning("dropped %d episodes beyond max_staleness=%d (current version %d)", n,
                        self.max_staleness, current_version)

    def take_acks(self) -> list[str]:
        """Entry ids that need acknowledging though not trained on (stale drops, duplicates)."""
        ids, self._unacked = self._unacked, []
        return ids


class TrainerService:
    def __init__(self, cfg: RunConfig, rank: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank
        tc = cfg.trainer
        self.device = torch.device(cfg.model.device)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.model = load_model(cfg.model)
        self.learner = Learner(self.model, tc, int(self.tokenizer.pad_token_id), self.device,
                               max_completion_tokens=cfg.rollout.max_new_tokens)
        self.header = StatusHeader("trainer")
        self.step = 0
        self.weight_version = 0
        self.episodes_trained = 0
        self.finished = False
        self.publishing = False
        self.stream = EpisodeStream.from_url(cfg.redis.url, cfg.redis.stream, cfg.redis.group)
        self.versions = VersionSource(self.stream.client, cfg.redis.version_key)
        self.collector = GroupCollector(self.stream, tc.consumer or f"trainer-rank{rank}",
                                        cfg.rollout.max_staleness, tc.read_block_ms)
        self._t0 = time.monotonic()
        self._last_step_t = self._t0
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = cfg.metrics_path.open("a")

    def status(self) -> trainer_pb2.TrainerStatus:
        return trainer_pb2.TrainerStatus(
            component=self.header.message(), step=self.step, weight_version=self.weight_version,
            episodes_trained=self.episodes_trained, episodes_dropped_stale=self.collector.episodes_dropped_stale,
            groups_per_step=self.cfg.trainer.groups_per_step, finished=self.finished, publishing=self.publishing)

    async def publish(self) -> int:
        """Allocate a fresh version from the durable counter and push the current weights under it."""
        self.publishing = True
        try:
            version = await self.versions.allocate()
            await self.push_weights(version)
        finally:
            self.publishing = False
        return version

    async def push_weights(self, version: int) -> None:
        tc = self.cfg.trainer
        messages = await asyncio.to_thread(
            lambda: list(iter_update_messages(model_tensors(self.model), version, tc.weight_chunk_bytes)))

        async def gen() -> AsyncIterator[WeightUpdateMessage]:
            for m in messages:
                yield m

        async with insecure_channel(self.cfg.inference.server.target) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            for attempt in range(1, 4):
                try:
                    resp = await stub.UpdateWeights(gen(), timeout=tc.weight_push_timeout_s)
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                            or attempt == 3:
                        raise RuntimeError(f"weight push of version {version} failed: "
                                           f"{exc.code().name}: {exc.details()}") from exc
                    log.warning("weight push attempt %d failed (%s); retrying", attempt, exc.code().name)
                    await asyncio.sleep(0.5 * attempt)
        self.weight_version = version
        log.info("published weight version %d (%d bytes, applied in %.3fs)", version, resp.bytes_received,
                 resp.apply_s)

    def _write_metrics(self, row: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()

    async def sft_warmup(self) -> None:
        tc = self.cfg.trainer
        rows = load_jsonl(self.cfg.rollout.dataset)
        eos = int(self.tokenizer.eos_token_id)
        enc = [(self.tokenizer(r.prompt, add_special_tokens=False)["input_ids"],
                [*self.tokenizer(r.answer, add_special_tokens=False)["input_ids"], eos]) for r in rows]
        gen = torch.Generator().manual_seed(self.cfg.seed)
        for i in range(1, tc.sft_warmup_steps + 1):
            idx = torch.randint(len(enc), (tc.sft_batch_size,), generator=gen).tolist()
            stats = await asyncio.to_thread(self.learner.sft_step, [enc[j][0] for j in idx],
                                            [enc[j][1] for j in idx])
            self._write_metrics({"phase": "sft", "sft_step": i, "loss": stats.loss, "grad_norm": stats.grad_norm,
                                 "time_s": time.monotonic() - self._t0})
        log.info("supervised warm-up done (%d steps)", tc.sft_warmup_steps)
        await self.publish()

    async def train(self) -> None:
        tc = self.cfg.trainer
        await self.stream.ensure_group()
        # The weights on disk get a fresh version too: inference and trainer agree on what is served, and a
        # restarted trainer never reuses a version.
        await self.publish()
        if tc.sft_warmup_steps > 0:
            await self.sft_warmup()
        self.header.state = ServingState.SERVING_STATE_SERVING
        while self.step < tc.total_steps:
            groups = await self.collector.collect(tc.groups_per_step, self.weight_version)
            episodes = [ep for g in groups for ep in g.episodes]
            staleness = torch.tensor([self.weight_version - min(ep.token_weight_versions, default=0)
                                      for ep in episodes], dtype=torch.float32)
            t_step = time.monotonic()
            stats = await asyncio.to_thread(self.learner.rl_step, episodes)
            await self.publish()
            acked = await self.stream.ack([e.entry_id for g in groups for e in g.entries]
                                          + self.collector.take_acks())
            self.step += 1
            self.episodes_trained += len(episodes)
            self._log_step(episodes, staleness, stats, time.monotonic() - t_step, acked)
            if tc.checkpoint_every and self.step % tc.checkpoint_every == 0 and self.step < tc.total_steps:
                await asyncio.to_thread(self.checkpoint)
        await asyncio.to_thread(self.checkpoint)
        self.finished = True
        self.header.state = ServingState.SERVING_STATE_STOPPED

    def checkpoint(self) -> None:
        save_checkpoint(self.cfg.checkpoint_dir, self.step, self.weight_version, self.model, self.tokenizer,
                        self.learner.optimizer, self.cfg.trainer.keep_checkpoints,
                        {"episodes_trained": self.episodes_trained})

    def _log_step(self, episodes: list[Episode], staleness: torch.Tensor, stats: StepStats, step_s: float,
                  acked: int) -> None:
        now = time.monotonic()
        rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float64)
        components: dict[str, list[float]] = {}
        for ep in episodes:
            for k, v in ep.reward_components.items():
                components.setdefault(k, []).append(v)
        row = {
            "step": self.step, "weight_version": self.weight_version,
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
            **{f"reward/{k}": sum(v) / len(v) for k, v in sorted(components.items())},
            "episodes": len(episodes), "tokens": stats.tokens,
            "staleness_mean": float(staleness.mean()), "staleness_max": int(staleness.max()),
            "staleness_hist": {str(lag): int(n) for lag, n in
                               zip(*[t.tolist() for t in staleness.long().unique(return_counts=True)], strict=True)},
            "episodes_dropped_stale": self.collector.episodes_dropped_stale,
            "episodes_trained": self.episodes_trained, "acked": acked,
            "loss": stats.loss, "grad_norm": stats.grad_norm, "clip_frac": stats.clip_frac,
            "ratio_mean": stats.ratio_mean, "kl": stats.kl, "lr": stats.lr,
            "importance_mean": stats.importance_mean, "importance_max": stats.importance_max,
            "logprob_diff_mean": stats.logprob_diff_mean,
            "completion_len_mean": sum(len(ep.completion_token_ids) for ep in episodes) / len(episodes),
            "episodes_per_s": len(episodes) / max(now - self._last_step_t, 1e-9),
            "step_time_s": step_s, "time_s": now - self._t0,
        }
        self._last_step_t = now
        self._write_metrics(row)
        log.info("step %d version %d reward %.3f staleness max %d loss %.4f", self.step, self.weight_version,
                 row["reward_mean"], row["staleness_max"], stats.loss)

    async def close(self) -> None:
        self._metrics.close()
        await self.stream.close()


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, service: TrainerService) -> None:
        self.service = service

    async def GetStatus(self, request: trainer_pb2.GetTrainerStatusRequest,
                        context: grpc.aio.ServicerContext) -> trainer_pb2.TrainerStatus:
        return self.service.status()


def create_trainer_server(service: TrainerService) -> ServerHandle:
    tc = service.cfg.trainer
    servicer = TrainerServicer(service)
    return create_server(
        tc.server, [lambda s: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, s)],
        [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name])
