"""Rollout's group commit (real redis-server): groups that finish together are appended in one MULTI, in order,
and the stream and the recorded progress are exactly what one transaction per group would have written."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from relayrl.common.redis_keys import STREAM_FIELD
from relayrl.rollout.group_commit import AppendFailed
from relayrl.rollout.progress import ProgressStore
from tests.conftest import RedisServer
from tests.integration.test_redis_oom import STREAM, episodes, producer_on

pytestmark = pytest.mark.integration


async def test_groups_finishing_together_share_one_transaction_and_every_seq_is_recorded_once(
    redis_server: RedisServer,
) -> None:
    async def go() -> tuple[int, int, int, list[int], dict[str, int]]:
        async with producer_on(redis_server, retry_s=5.0) as producer:
            # seqs finish out of order: 2 and 4 leave gaps until 1 and 3 land in the same commit
            await asyncio.gather(*(producer._append(seq, episodes(f"g{seq}")) for seq in (0, 2, 4, 1, 3)))
            stored = await ProgressStore(producer.stream.client, producer.stream.keys).load()
            return (
                producer.appends.committed,
                producer.groups_produced,
                stored.watermark,
                sorted(stored.done),
                {"appended": stored.appended, "memory_watermark": producer.progress.watermark},
            )

    commits, produced, watermark, done, counts = await go()

    admin = redis.Redis(port=redis_server.port)
    group_ids = [e[1][STREAM_FIELD] for e in admin.xrange(STREAM)]
    assert produced == 5
    assert len(group_ids) == 5  # every group appended once
    assert commits == 2  # the first group alone (it took the lock at once), then the four queued behind it
    assert watermark == 5 and done == []  # every seq below the watermark: none missing, none regenerated
    assert counts == {"appended": 5, "memory_watermark": 5}


async def _first_commit_fails(producer: Any, error: Exception) -> tuple[list[BaseException | None], int]:
    """Groups 0, 1 and 2 appended while the first transaction (group 0's, which took the lock at once) waits until
    1 and 2 queue behind it, then fails with ``error``; later transactions run as usual. Returns each append's
    error (None: appended) and how many transactions were tried."""
    commit = producer.appends._commit
    entered, release, calls = asyncio.Event(), asyncio.Event(), []

    async def fail_first(batch: list[Any]) -> None:
        calls.append([seq for seq, _, _ in batch])
        if len(calls) == 1:
            entered.set()
            await release.wait()
            raise error
        await commit(batch)

    producer.appends._commit = fail_first
    first = asyncio.create_task(producer._append(0, episodes("g0")))
    await entered.wait()
    queued = [asyncio.create_task(producer._append(seq, episodes(f"g{seq}"))) for seq in (1, 2)]
    await asyncio.sleep(0)  # let them queue their records behind the lock
    release.set()
    results = await asyncio.gather(first, *queued, return_exceptions=True)
    return [r if isinstance(r, BaseException) else None for r in results], len(calls)


async def test_a_failed_commit_fails_only_its_callers_group_and_the_queued_groups_are_written_after_it(
    redis_server: RedisServer,
) -> None:
    async def go() -> tuple[list[BaseException | None], int, list[int]]:
        async with producer_on(redis_server, retry_s=5.0) as producer:
            results, _ = await _first_commit_fails(producer, ValueError("failed for another reason than Redis"))
            stored = await ProgressStore(producer.stream.client, producer.stream.keys).load()
            return results, producer.groups_produced, sorted(stored.done | set(range(stored.watermark)))

    results, produced, recorded = await go()

    admin = redis.Redis(port=redis_server.port)
    assert isinstance(results[0], ValueError)  # the caller whose transaction failed sees why
    assert results[1:] == [None, None]  # the queued groups were written by their own callers afterwards
    assert produced == 2 and admin.xlen(STREAM) == 2
    assert recorded == [1, 2]  # seq 0 is missing: its group is retried (or skipped) by _group, not lost


async def test_redis_down_past_retry_s_fails_every_waiting_group_at_once_and_every_later_one(
    redis_server: RedisServer,
) -> None:
    """One outage costs one redis.retry_s, not one per group: rollout used to retry each waiting group's append for
    the whole budget in turn (eight groups in flight kept an orphaned rollout up for 25 s of a 5 s budget)."""

    async def go() -> tuple[list[BaseException | None], int, BaseException | None, BaseException | None]:
        async with producer_on(redis_server, retry_s=0.5) as producer:
            # what redis_retry re-raises once redis.retry_s is spent
            results, commits = await _first_commit_fails(producer, ConnectionError("Error 111 connecting"))
            later = await asyncio.gather(producer._append(3, episodes("g3")), return_exceptions=True)
            return results, commits, later[0], producer.appends.failure

    results, commits, later, failure = await go()

    assert commits == 1  # the queued groups did not retry the dead Redis each in turn
    assert all(isinstance(r, AppendFailed) for r in results) and isinstance(later, AppendFailed)
    assert failure is not None and "redis.retry_s = 0.5s" in str(failure)
    assert redis.Redis(port=redis_server.port).xlen(STREAM) == 0  # nothing written after the failure either
