"""Retrying Redis operations through a transient outage (a restarted redis-server, a dropped connection), and,
for writers that ask for it, through a full Redis (maxmemory reached under ``noeviction``: the write is refused
with an OOM error and nothing of it is applied, so backing off and retrying is backpressure, not a loss).

What a full Redis refuses (redis-server 7.0, checked against the real server by tests/security/
test_trainer_redis_full.py): every command flagged ``denyoom`` (SET, INCR, HSET, HSETNX, XADD, XGROUP CREATE, a
MULTI holding one) before it runs. A Lua script without a ``#!lua`` shebang (relayrl's) runs, and its first
``denyoom`` command fails the script with OOM before the script has written anything, so a refused script applied
nothing either. XACK, XTRIM, XCLAIM, XREADGROUP, DEL and every read still go through: they never wait here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

T = TypeVar("T")
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def is_oom(exc: BaseException) -> bool:
    """Whether Redis refused a command for lack of memory (``OOM command not allowed ...``)."""
    return isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError) and "OOM" in str(exc)[:80])


class OomBackpressure:
    """A service's writes refused by a full Redis and retried (:func:`redis_retry`'s ``backpressure``): ``retries``
    counts the refusals, ``waiting`` the writes that wait now. One warning when the first write starts waiting and
    one line when the last one went through (an episode of backpressure), never one per retry or per write; no
    command, key or value is logged."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.retries = 0  # refusals, each followed by a back-off and a retry
        self.episodes = 0  # times the service started waiting on a full Redis
        self.waiting = 0  # writes waiting now
        self._since = 0.0
        self._episode_retries = 0

    @property
    def full(self) -> bool:
        return self.waiting > 0

    def refused(self, what: str, first: bool, budget_s: float) -> None:
        """A write (``what``) was refused; ``first``: its first refusal (it starts waiting)."""
        self.retries += 1
        self._episode_retries += 1
        if not first:
            return
        self.waiting += 1
        if self.waiting == 1:
            self.episodes += 1
            self._since, self._episode_retries = time.monotonic(), 1
            log.warning(
                "redis is full (maxmemory reached under noeviction): the %s waits on its %s and retries "
                "it for up to %gs (redis.retry_s); nothing that depends on it proceeds meanwhile",
                self.service,
                what,
                budget_s,
            )

    def released(self, what: str, done: bool) -> None:
        """A waiting write ended: ``done`` (it went through), or not (it gave up or was cancelled)."""
        self.waiting -= 1
        if self.waiting == 0 and done:
            log.info(
                "redis accepts writes again: the %s's %s went through after %d refusals over %.1fs",
                self.service,
                what,
                self._episode_retries,
                time.monotonic() - self._since,
            )


def _full_error(what: str, budget_s: float, refusals: int) -> OutOfMemoryError:
    return OutOfMemoryError(
        f"redis stayed full (maxmemory reached under noeviction) for redis.retry_s = {budget_s:g}s: {what} was "
        f"refused {refusals} times and not applied; free memory in Redis (or raise its maxmemory) and restart"
    )


async def redis_retry(
    op: Callable[[], Awaitable[T]],
    what: str,
    budget_s: float,
    on_reconnect: Callable[[], None] | None = None,
    on_oom: Callable[[], None] | None = None,
    backpressure: OomBackpressure | None = None,
) -> T:
    """Run ``op``; on a connection error retry with backoff for up to ``budget_s`` seconds, then re-raise.
    ``on_reconnect`` runs once the operation succeeds after a failure. With ``on_oom`` or ``backpressure``, an OOM
    refusal is retried the same way (same budget), ``on_oom`` running before each retry and ``backpressure``
    counting it, and once the budget is spent an OutOfMemoryError naming it is raised; without either, OOM is
    raised at once."""
    deadline = time.monotonic() + budget_s
    delay = 0.1
    failed = warned = outage = False
    refusals = 0  # of this write
    done = False
    try:
        while True:
            try:
                result = await op()
            except (*TRANSIENT, ResponseError) as exc:
                oom = is_oom(exc) and (on_oom is not None or backpressure is not None)
                if isinstance(exc, ResponseError) and not oom:
                    raise
                if time.monotonic() + delay > deadline:
                    if oom:
                        raise _full_error(what, budget_s, refusals + 1) from None
                    raise
                if oom:
                    if on_oom is not None:
                        on_oom()
                    if backpressure is not None:
                        backpressure.refused(what, refusals == 0, budget_s)
                    refusals += 1
                outage = outage or not oom
                if not warned and not (oom and backpressure is not None):  # backpressure logs once per episode
                    warned = True  # an OOM error's text may hold the refused command: not logged
                    log.warning(
                        "redis %s during %s (%s); retrying for up to %.1fs",
                        "out of memory" if oom else "unavailable",
                        what,
                        "maxmemory reached under noeviction" if oom else exc,
                        budget_s,
                    )
                failed = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            done = True
            if failed:
                if outage or backpressure is None:
                    log.info("redis reachable again (%s)", what)
                if on_reconnect is not None:
                    on_reconnect()
            return result
    finally:
        if refusals and backpressure is not None:
            backpressure.released(what, done)
