"""The trainer's counters: what it trained and dropped, kept in checkpoints and read by status and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relayrl.common.books import DROPS
from relayrl.common.retry import redis_retry
from relayrl.common.stream import EpisodeStream
from relayrl.trainer.status_watch import StatusPulse


@dataclass
class TrainerProgress:
    step: int = 0
    episodes_trained: int = 0
    groups_trained: int = 0
    finished: bool = False
    # drops over all ranks and restarts, from Redis (refreshed by rank 0 after each step)
    groups_dropped_stale: int = 0
    episodes_dropped_stale: int = 0
    groups_dropped_reward_error: int = 0  # whole groups, from Redis
    episodes_dropped_reward_error: int = 0  # their episodes + errored episodes of trained groups
    # zero-advantage groups dropped by dynamic sampling (trainer.dynamic_sampling), from Redis
    groups_dropped_zero_advantage: int = 0
    episodes_dropped_zero_advantage: int = 0
    # entries moved to the dead-letter stream (undecodable or invalid), over all ranks and restarts, from Redis
    groups_invalid: int = 0
    episodes_invalid: int = 0
    # errored episodes excluded from trained groups, over every rank (kept in checkpoints like the others)
    episodes_excluded_reward_error: int = 0
    queue_depth: tuple[int | None, int] = (None, 0)  # (lag, pending), read with the drops (rank 0)
    staleness_counts: dict[int, int] = field(default_factory=dict)  # samples trained per staleness (rank 0)
    last_reward_mean: float | None = None  # mean reward of the last step's episodes (rank 0; None before one)
    # notified whenever the status may have changed (WatchStatus, relayrl.trainer.status_watch)
    changed: StatusPulse = field(default_factory=StatusPulse, compare=False, repr=False)

    def checkpoint_counters(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the step (``extra`` of relayrl.trainer.checkpoint)."""
        return {
            "episodes_trained": self.episodes_trained,
            "groups_trained": self.groups_trained,
            "episodes_excluded_reward_error": self.episodes_excluded_reward_error,
        }

    def restore(self, step: int, counters: dict[str, Any]) -> None:
        self.step = step
        self.episodes_trained = int(counters.get("episodes_trained", 0))
        self.groups_trained = int(counters.get("groups_trained", 0))
        self.episodes_excluded_reward_error = int(counters.get("episodes_excluded_reward_error", 0))

    def advance(self) -> None:
        """The step is done (trained and its weights published or publishing): status watchers see it at once."""
        self.step += 1
        self.changed.notify()

    def exclude(self, episodes: int) -> None:
        """``episodes`` errored episodes of trained groups were excluded from the loss (counted in the drops at
        once, whether or not a :meth:`refresh_drops` is under way)."""
        self.episodes_excluded_reward_error += episodes
        self.episodes_dropped_reward_error += episodes

    async def refresh_drops(self, stream: EpisodeStream, retry_s: float) -> None:
        """Drop and invalid counts over every rank and restart, and the queue depth, from Redis (one round trip)."""
        read = await redis_retry(stream.books, "read the books", retry_s)
        for outcome in DROPS:  # relayrl.common.books
            groups, episodes = read.dropped[outcome.reason]
            setattr(self, outcome.groups, groups)
            setattr(self, outcome.episodes, episodes)
        self.episodes_dropped_reward_error += self.episodes_excluded_reward_error  # and those of trained groups
        self.groups_invalid, self.episodes_invalid = read.invalid
        self.queue_depth = (read.lag, read.pending)
        self.changed.notify()
