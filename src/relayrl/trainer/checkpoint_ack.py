"""Checkpoint, then acknowledge: the exactly-once effect of a group.

A group's stream entry is acknowledged only after a checkpoint that includes its effect is durable. Each
checkpoint records, per rank, the ids of the groups consumed (trained or dropped) since the previous one. On
restart each rank re-reads its own pending entries first, acknowledges (without training) the groups the
restored checkpoint already holds, trains the rest, then reads new entries (see relayrl.trainer.groups).
After each acknowledgement the stream is trimmed below the oldest entry still pending (or, with none pending,
the last delivered one): Redis memory stays bounded by the entries not yet durable, and an unread or
unacknowledged entry is never trimmed (EpisodeStream.trim_acked).

An operator's checkpoint request reaches rank 0 (the control plane); every rank learns it with the next weight
version's broadcast, so all of them checkpoint after the same step.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import torch

from relayrl.common.retry import OomBackpressure, redis_retry
from relayrl.common.stream import EpisodeStream
from relayrl.trainer.checkpoint import save_checkpoint
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.groups import GroupCollector

log = logging.getLogger(__name__)


class CheckpointAck:
    def __init__(
        self,
        root: Path,
        every: int,
        keep: int,
        model: Any,
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        coll: Collectives,
        collector: GroupCollector,
        stream: EpisodeStream,
        retry_s: float,
        export_model: Any | None = None,
        backpressure: OomBackpressure | None = None,
    ) -> None:
        self.root = root
        # XACK and XTRIM free memory and a full Redis runs them; should one be refused, it waits like any write
        self.backpressure = backpressure or OomBackpressure("trainer")
        self.export_model = export_model  # FSDP2, rank 0: the unsharded copy the Hugging Face export is written from
        self.every = every
        self.keep = keep
        self.model = model
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        self.coll = coll
        self.collector = collector
        self.stream = stream
        self.retry_s = retry_s
        self.requested = False  # rank 0, by the control plane; all ranks learn it with the next version
        self.now = False  # every rank: checkpoint after this step (the request, as broadcast)
        self.last_step = 0

    def due(self, step: int, total_steps: int) -> bool:
        """A checkpoint before the final one (which always comes): every N steps, or requested."""
        scheduled = bool(self.every) and step % self.every == 0
        return (scheduled or self.now) and step < total_steps

    async def save_and_ack(self, step: int, weight_version: int, counters: dict[str, Any]) -> None:
        """Save a checkpoint (atomic), and only once it is durable acknowledge the groups it holds."""
        collector = self.collector
        await asyncio.to_thread(
            save_checkpoint,
            self.root,
            step,
            weight_version,
            self.model,
            self.tokenizer,
            self.optimizer,
            self.keep,
            counters,
            self.coll,
            collector.consumed_ids,
            self.export_model,
        )
        ids = collector.unacked + collector.done_on_resume
        acked = await redis_retry(lambda: self.stream.ack(ids), "ack", self.retry_s, backpressure=self.backpressure)
        # bounded memory: what every consumer group has acknowledged goes (never an unread or pending entry)
        minid = await redis_retry(self.stream.trim_acked, "trim", self.retry_s, backpressure=self.backpressure)
        log.info("checkpoint at step %d durable; acknowledged %d groups; stream trimmed below %s", step, acked, minid)
        self.last_step = step
        if self.now:  # the operator's request (broadcast with this step's version) is served
            self.requested = self.now = False
        collector.consumed_ids, collector.unacked, collector.done_on_resume = [], [], []
