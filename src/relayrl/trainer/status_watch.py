"""The trainer's status as a stream of changes (``WatchStatus``): rollout follows it instead of polling.

Whatever changes the status calls :meth:`StatusPulse.notify` (the end of a step, a publication starting or
landing, the books read from Redis, the end of the run); each watcher then sends the status again if it
differs from the one it sent last (the uptime of the header does not count). Between pulses a watcher reads the
drop counts from Redis every ``refresh_s``: a group dropped by another rank releases rollout's admission without
waiting for rank 0's next step, as a GetStatus call would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from relayrl.common.pb import trainer_pb2

# How often a watcher without a pulse re-reads the books (drops by any rank) and compares.
WATCH_REFRESH_S = 0.2
# Watchers served at once (rollout has one per replica; status tools add a few). Over it: RESOURCE_EXHAUSTED.
MAX_WATCHERS = 32


class StatusPulse:
    """A change counter coroutines can wait on. Call :meth:`notify` on the event loop's thread."""

    def __init__(self) -> None:
        self.count = 0
        self._event = asyncio.Event()

    def notify(self) -> None:
        self.count += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, seen: int, timeout_s: float) -> bool:
        """Wait until the count differs from ``seen`` or ``timeout_s`` passes; True when it changed."""
        if self.count != seen:
            return True
        event = self._event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
        return self.count != seen


def _comparable(status: trainer_pb2.TrainerStatus) -> bytes:
    """The status without the header's uptime (which changes on every read)."""
    copy = trainer_pb2.TrainerStatus()
    copy.CopyFrom(status)
    copy.component.uptime_s = 0.0
    return copy.SerializeToString(deterministic=True)


async def status_changes(
    pulse: StatusPulse,
    status: Callable[[], trainer_pb2.TrainerStatus],
    refresh_books: Callable[[], Awaitable[None]],
    refresh_s: float = WATCH_REFRESH_S,
) -> AsyncIterator[trainer_pb2.TrainerStatus]:
    """The status now, then each change of it, until the run has finished (the caller's deadline ends it
    earlier)."""
    await refresh_books()
    last: bytes | None = None
    while True:
        seen = pulse.count
        current = status()
        key = _comparable(current)
        if key != last:
            yield current
            last = key
        if current.finished:
            return
        if not await pulse.wait(seen, refresh_s):
            await refresh_books()  # quiet for a while: drops by other ranks live in Redis
