"""Retrying Redis operations through a transient outage (a restarted redis-server, a dropped connection), and,
for writers that ask for it, through a full Redis (maxmemory reached under ``noeviction``: the write is refused
with an OOM error and nothing of it is applied, so backing off and retrying is backpressure, not a loss)."""

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


async def redis_retry(op: Callable[[], Awaitable[T]], what: str, budget_s: float,
                      on_reconnect: Callable[[], None] | None = None,
                      on_oom: Callable[[], None] | None = None) -> T:
    """Run ``op``; on a connection error retry with backoff for up to ``budget_s`` seconds, then re-raise.
    ``on_reconnect`` runs once the operation succeeds after a failure. With ``on_oom``, an OOM refusal is retried
    the same way (same budget), ``on_oom`` running before each retry; without it, OOM is raised at once."""
    deadline = time.monotonic() + budget_s
    delay = 0.1
    failed = False
    while True:
        try:
            result = await op()
        except (*TRANSIENT, ResponseError) as exc:
            oom = is_oom(exc)
            if (isinstance(exc, ResponseError) and not (oom and on_oom is not None)) \
                    or time.monotonic() + delay > deadline:
                raise
            if oom and on_oom is not None:
                on_oom()
            if not failed:  # an OOM error's text holds the refused command and its arguments: not logged
                log.warning("redis %s during %s (%s); retrying for up to %.1fs",
                            "out of memory" if oom else "unavailable", what,
                            "maxmemory reached under noeviction" if oom else exc, budget_s)
            failed = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            continue
        if failed:
            log.info("redis reachable again (%s)", what)
            if on_reconnect is not None:
                on_reconnect()
        return result
