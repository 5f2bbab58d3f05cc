"""A full Redis is backpressure for rollout, not a crash and not a loss: against a real redis-server at its
``maxmemory`` under ``noeviction``, the group's append is refused (OOM), backs off and retries within
``redis.retry_s``, is counted, and admits no new group meanwhile; once memory is freed the group lands exactly
once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import redis
from redis.exceptions import OutOfMemoryError

from relayrl.common.dataset import PromptCursor
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.common.retry import redis_retry
from relayrl.common.stream import EpisodeStream
from relayrl.config.rollout import RolloutConfig
from relayrl.rollout.admission import TrainerView
from relayrl.rollout.clients import RolloutClients
from relayrl.rollout.group_commit import AppendFailed
from relayrl.rollout.producer import RolloutProducer
from tests.conftest import RedisServer
from tests.polling import until

pytestmark = pytest.mark.integration

STREAM, GROUP = "relayrl:episodes", "trainer"


def fill(server: RedisServer) -> redis.Redis:
    """Fill Redis past a maxmemory set 500 kB below what it uses now (noeviction: writes are refused). The filler
    (2 MB) is written in 100 kB commands, so no large query buffer that Redis frees later sits in the figure. What it
    uses is what Redis compares with maxmemory: ``used_memory`` less ``mem_not_counted_for_evict`` (the AOF buffer,
    which can hold the filler while a slow disk postpones the everysec write: counted, it would set the limit above
    what Redis compares, and no write would be refused)."""
    admin = redis.Redis(port=server.port)
    for chunk in range(20):
        admin.hset("filler", mapping={f"{chunk}:{i}": b"x" * 1000 for i in range(100)})
    memory = admin.info("memory")
    admin.config_set("maxmemory", int(memory["used_memory"]) - int(memory["mem_not_counted_for_evict"]) - 500_000)
    return admin


@asynccontextmanager
async def producer_on(server: RedisServer, retry_s: float) -> AsyncIterator[RolloutProducer]:
    """A rollout producer on the real Redis that the trainer's status lets admit groups (the inference, reward
    and trainer clients are never called by the append path)."""
    stream = EpisodeStream.from_url(server.url, STREAM, GROUP)
    await stream.ensure_group()
    rows = [{"prompt": "1+1=", "answer": "2", "id": "p0"}]
    async with RolloutClients.connect("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1") as clients:
        producer = RolloutProducer(
            RolloutConfig(), stream, PromptCursor(rows, False, 0), clients, redis_retry_s=retry_s
        )
        producer.trainer_view = TrainerView(step=0, weight_version=0, groups_per_step=4, reachable=True, serving=True)
        try:
            yield producer
        finally:
            await stream.close()


def episodes(group_id: str) -> list[Episode]:
    return [Episode(episode_id=f"{group_id}-{i}", group_id=group_id, sample_index=i, group_size=2) for i in range(2)]


async def test_append_to_a_full_redis_blocks_admission_then_lands_exactly_once_when_memory_frees(
    redis_server: RedisServer,
) -> None:
    async def go() -> dict[str, object]:
        async with producer_on(redis_server, retry_s=30.0) as producer:
            admitted_before = producer.can_admit()
            admin = fill(redis_server)
            append = asyncio.create_task(producer._append(0, episodes("g-oom")))
            assert await until(lambda: producer.redis_oom_retries >= 2)
            during = {
                "blocked": producer.append_blocked,
                "admits": producer.can_admit(),
                "length": admin.xlen(STREAM),
                "done": append.done(),
                "status_blocked": producer.state()["redis_oom_retries"] >= 2,
            }
            admin.delete("filler")  # memory frees: the next retry goes through
            await asyncio.wait_for(append, 20)
            entries = admin.xrange(STREAM)
            return {
                "before": admitted_before,
                "during": during,
                "ids": [e[0] for e in entries],
                "after_admits": producer.can_admit(),
                "after_blocked": producer.append_blocked,
                "produced": producer.groups_produced,
                "appended": producer.progress.appended,
            }

    seen = await go()

    assert seen["before"] is True
    assert seen["during"] == {"blocked": True, "admits": False, "length": 0, "done": False, "status_blocked": True}
    assert len(seen["ids"]) == 1  # type: ignore[arg-type]
    assert seen["after_admits"] is True and seen["after_blocked"] is False
    assert seen["produced"] == 1 and seen["appended"] == 1


async def test_append_to_a_redis_that_stays_full_fails_after_redis_retry_s_with_nothing_half_written(
    redis_server: RedisServer,
) -> None:
    async def go() -> tuple[type[BaseException] | None, int, bool, int, dict[bytes, bytes]]:
        async with producer_on(redis_server, retry_s=0.5) as producer:
            admin = fill(redis_server)
            error: type[BaseException] | None = None
            try:
                await asyncio.wait_for(producer._append(0, episodes("g-full")), 10)
            except AppendFailed as exc:  # rollout stops, naming redis.retry_s and the full Redis
                error = type(exc.__cause__) if exc.__cause__ is not None else type(exc)
            progress = admin.hgetall(producer.stream.keys.rollout_progress)
            return error, admin.xlen(STREAM), producer.append_blocked, producer.redis_oom_retries, progress

    error, length, blocked, retries, progress = await go()

    assert error is OutOfMemoryError
    assert length == 0 and progress == {}  # the MULTI was refused whole: no entry, no progress record
    assert blocked is False and retries >= 1


async def test_readers_that_do_not_ask_for_oom_retries_get_the_error_at_once(redis_server: RedisServer) -> None:
    async def go() -> tuple[int, type[BaseException] | None]:
        stream = EpisodeStream.from_url(redis_server.url, STREAM, GROUP)
        fill(redis_server)
        calls = 0

        async def write() -> None:
            nonlocal calls
            calls += 1
            await stream.client.set("relayrl:probe", b"1")

        try:
            await redis_retry(write, "probe", budget_s=30.0)
        except OutOfMemoryError as exc:
            return calls, type(exc)
        finally:
            await stream.close()
        return calls, None

    assert await go() == (1, OutOfMemoryError)


async def test_a_rollout_started_on_a_full_redis_waits_for_its_consumer_group_then_starts_when_memory_frees(
    redis_server: RedisServer,
) -> None:
    async def go() -> tuple[bool, int, BaseException | None]:
        async with producer_on(redis_server, retry_s=30.0) as producer:
            admin = fill(redis_server)  # XGROUP CREATE is refused now, though the group already exists
            stop = asyncio.Event()
            stop.set()  # run() returns as soon as it has started: its group ensured and its progress read
            run = asyncio.create_task(producer.run(stop))
            assert await until(lambda: producer.redis_oom_retries >= 2 or run.done())
            waited = not run.done()
            admin.delete("filler")
            await asyncio.wait_for(asyncio.gather(run, return_exceptions=True), 20)
            return waited, producer.redis_oom_retries, run.exception()

    waited, retries, error = await go()

    assert error is None and waited and retries >= 2  # a restarted rollout is backpressured, not killed
