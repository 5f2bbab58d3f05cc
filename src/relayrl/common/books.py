"""The run's books, declared once: what became of every group rollout produced.

    groups produced = trained + dropped (one count per reason) + invalid + pending

Each outcome below has a ``groups_<key>`` and an ``episodes_<key>`` counter. The trainer keeps them
(relayrl.trainer.progress: trained in its checkpoints, drops and invalid entries from Redis), and everything that
shows or checks the books reads them by these names: the trainer's status (``TrainerStatus`` has a field for each),
its Prometheus series (``relayrl_trainer_<name>``), the metrics row, rollout's admission (groups that left the books
no longer count against the staleness bound), the launcher's summary, ``relayrl status`` and the dashboard. A new
drop reason is one line in :data:`DROPS` (and its fields where typed: the proto, the progress, the metrics row; a
test checks each has them all).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Outcome:
    key: str  # "trained", "dropped_<reason>", "invalid"
    words: str  # in the one-line books: "dropped as stale"
    groups_help: str
    episodes_help: str

    @property
    def groups(self) -> str:
        return f"groups_{self.key}"

    @property
    def episodes(self) -> str:
        return f"episodes_{self.key}"

    @property
    def reason(self) -> str:
        """A drop's reason (``stale`` of ``dropped_stale``): its record's name in Redis (relayrl.common.redis_keys)."""
        return self.key.removeprefix("dropped_")


TRAINED = Outcome("trained", "trained", "Groups trained on.", "Episodes trained on.")
DROPS: tuple[Outcome, ...] = (  # the key is "dropped_" + the reason, which names its record in Redis
    Outcome(
        "dropped_stale",
        "dropped as stale",
        "Groups dropped beyond the staleness bound (all ranks and restarts).",
        "Episodes dropped beyond the staleness bound (all ranks and restarts).",
    ),
    Outcome(
        "dropped_reward_error",
        "dropped for reward errors",
        "Groups dropped because every episode's scoring failed.",
        "Episodes excluded from the loss because scoring failed (those of dropped groups and the "
        "failed ones of trained groups).",
    ),
    Outcome(
        "dropped_zero_advantage",
        "dropped with zero advantage",
        "Groups dropped by dynamic sampling: every valid episode had the same reward.",
        "Episodes of those groups.",
    ),
)
INVALID = Outcome(
    "invalid",
    "invalid",
    "Stream entries that could not be decoded or validated, moved to the dead-letter stream (never trained).",
    "Episodes of those entries.",
)
OUTCOMES: tuple[Outcome, ...] = (TRAINED, *DROPS, INVALID)
PENDING_WORDS = "pending"  # read from the stream, not counted by the trainer: summary key groups_pending


def counters() -> Iterator[tuple[str, str]]:
    """Every counter of the books: (name, help), groups first, in :data:`OUTCOMES` order."""
    for outcome in OUTCOMES:
        yield outcome.groups, outcome.groups_help
    for outcome in OUTCOMES:
        yield outcome.episodes, outcome.episodes_help


COUNTER_NAMES: tuple[str, ...] = tuple(name for name, _ in counters())
DROP_REASONS: tuple[str, ...] = tuple(o.reason for o in DROPS)


def values(source: Any) -> dict[str, int]:
    """Every counter of ``source`` (any object with them as attributes: the progress, a status, a metrics row)."""
    return {name: int(getattr(source, name)) for name in COUNTER_NAMES}


def groups_left(source: Any) -> int:
    """Groups that left the books other than by training: every drop and every invalid entry of ``source``. They
    no longer count against rollout's admission bound."""
    return sum(int(getattr(source, o.groups)) for o in (*DROPS, INVALID))


def groups_handled(source: Any) -> int:
    """Groups trained or dropped (what a checkpoint consumed; invalid entries are acknowledged at once)."""
    return sum(int(getattr(source, o.groups)) for o in (TRAINED, *DROPS))
