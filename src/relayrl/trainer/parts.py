"""What one rank's training loop works with: its parts, built and wired by relayrl.trainer.runtime.Trainer (one
object instead of a constructor argument each; a test or a new loop builds the same object)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.common.service import StatusHeader
from relayrl.common.stream import EpisodeStream
from relayrl.config import RunConfig
from relayrl.trainer.checkpoint_ack import CheckpointAck
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.groups import GroupCollector
from relayrl.trainer.learner import Learner
from relayrl.trainer.progress import TrainerProgress
from relayrl.trainer.publication import VersionPublication
from relayrl.trainer.teacher import Teacher
from relayrl.trainer.tracking import Tracker


@dataclass(frozen=True)
class LoopParts:
    cfg: RunConfig
    learner: Learner  # the model, the optimizer and the step
    tokenizer: Any
    coll: Collectives  # every collective of this rank
    stream: EpisodeStream
    collector: GroupCollector  # this rank's groups, and the drops
    publication: VersionPublication  # weight versions and their pushes (rank 0)
    checkpoints: CheckpointAck  # checkpoints, then the acknowledgements of their groups
    progress: TrainerProgress  # the counters status and metrics read
    header: StatusHeader  # the serving state
    tracker: Tracker | None  # rank 0: metrics.jsonl and the tracking backends
    resumed_from: Path | None  # the checkpoint this incarnation resumed from
    teacher: Teacher | None = None  # on-policy distillation: scores each batch's tokens (relayrl.trainer.teacher)
    reference: Teacher | None = None  # the KL term's reference served by an endpoint (trainer.loss.reference_address)
