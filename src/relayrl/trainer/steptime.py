"""Where a training step's wall time goes: a host clock split into named parts (rank 0 reports its own).

The loop wraps each stretch of work in :meth:`StepClock.part`; :meth:`StepClock.close` ends a step's cycle and
returns :class:`StepTimes`, whose parts plus ``other`` add up to the cycle's wall time (the time since the
previous close). A cycle runs from one metrics row to the next, so the work done after a row is built (a
checkpoint after the step) is counted in the next row. Writing the row is a task beside the next step's wait for
data: it is counted where it delays the step (the data part, or the compute it slows), in no part of its own.

No host synchronisation is added to time anything: the clock reads the host's monotonic time around work that
already ends in one (the learner's ``.tolist()`` of the loss statistics, ``float(grad_norm)``, the push's
answer). On an accelerator, asynchronous kernels are therefore counted where the host waits for them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PARTS = ("data", "fwd_bwd", "optimizer", "publish", "checkpoint", "metrics")
COMPUTE_PARTS = ("fwd_bwd", "optimizer")  # everything else is plumbing


@dataclass(frozen=True)
class StepTimes:
    """One cycle: its wall time and its parts (seconds); ``other`` is the wall less the parts (never < 0)."""

    wall: float
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def other(self) -> float:
        return max(self.wall - sum(self.parts.values()), 0.0)


class StepClock:
    """Accumulates the time of named parts between two :meth:`close` calls (not thread-safe: the loop's task)."""

    def __init__(self) -> None:
        self._now = time.monotonic
        self._start = self._now()
        self._parts = dict.fromkeys(PARTS, 0.0)

    def reset(self, now: float | None = None) -> None:
        """Start a fresh cycle (what ran before is not counted anywhere)."""
        self._start = self._now() if now is None else now
        self._parts = dict.fromkeys(PARTS, 0.0)

    def add(self, name: str, seconds: float) -> None:
        self._parts[name] += seconds

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = self._now()
        try:
            yield
        finally:
            self._parts[name] += self._now() - t0

    def close(self, now: float) -> StepTimes:
        """End the cycle at ``now`` (a ``time.monotonic()`` reading) and start the next one there."""
        times = StepTimes(now - self._start, dict(self._parts))
        self.reset(now)
        return times


@dataclass
class Longest:
    """The longest step, weight push and checkpoint this rank measured (this incarnation): what a graceful stop
    may still have to wait for (relayrl.config.trainer.graceful_stop_s)."""

    step_s: float = 0.0
    push_s: float = 0.0
    checkpoint_s: float = 0.0

    def saw(self, step_s: float = 0.0, push_s: float = 0.0, checkpoint_s: float = 0.0) -> None:
        self.step_s = max(self.step_s, step_s)
        self.push_s = max(self.push_s, push_s)
        self.checkpoint_s = max(self.checkpoint_s, checkpoint_s)
