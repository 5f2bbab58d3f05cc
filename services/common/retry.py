"""Retrying Redis operations through a transient outage (a restarted redis-server, a dropped connection)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

T = TypeVar("T")
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


async def redis_retry(op: Callable[[], Awaitable[T]], what: str, budget_s: float,
                      on_reconnect: Callable[[], None] | None = None) -> T:
    """Run ``op``; on a connection error retry with backoff for up to ``budget_s`` seconds, then re-raise.
    ``on_reconnect`` runs once the operation succeeds after a failure."""
    deadline = time.monotonic() + budget_s
    delay = 0.1
    failed = False
    while True:
        try:
            result = await op()
        except TRANSIENT as exc:
            if time.monotonic() + delay > deadline:
                raise
            if not failed:
                log.warning("redis unavailable during %s (%s); retrying for up to %.0fs", what, exc, budget_s)
            failed = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            continue
        if failed:
            log.info("redis reachable again (%s)", what)
            if on_reconnect is not None:
                on_reconnect()
        return result
