"""A full Redis (anyone who can write to it can fill it; so can a stalled trainer) is backpressure for the trainer,
as it is for rollout: against a real redis-server at its ``maxmemory`` under ``noeviction``, each trainer write
(version allocation and registration, dead letter, drop record, consumer-group creation) is refused whole, waits
and retries for up to ``redis.retry_s``, is counted (``relayrl_trainer_redis_oom_retries``), and lands exactly
once when memory frees; past the bound the trainer stops with an OutOfMemoryError naming it, nothing half
written. Before this defence the first refused write raised out of the trainer at once and the run stopped.

Memory is freed from the test once the trainer has counted its refusals (a counter, not a sleep)."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
import redis
from redis.exceptions import OutOfMemoryError

from relayrl.common.redis_keys import STREAM_FIELD, RedisKeys
from relayrl.common.stream import EpisodeStream
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.groups import EntryChecks, GroupCollector
from relayrl.trainer.publication import VersionPublication
from relayrl.trainer.versions import VersionLineage, VersionSource
from tests.conftest import RedisServer
from tests.integration.test_redis_oom import fill
from tests.polling import until
from tests.security.test_bad_episodes import GARBAGE, _group

if TYPE_CHECKING:
    from relayrl.common.retry import OomBackpressure

pytestmark = [pytest.mark.security, pytest.mark.integration]

KEYS = RedisKeys(stream="s", group="g", version_counter="v")
OOM_SCRIPT = "return redis.call('INCR', KEYS[1])"


def _publication(client: Any, retry_s: float, versions: VersionSource | None = None) -> VersionPublication:
    """Rank 0's version publication on the real Redis (its publisher is never called: nothing is pushed here)."""
    return VersionPublication(
        SimpleNamespace(),
        versions or VersionSource(client, KEYS),  # type: ignore[arg-type]
        VersionLineage(client, KEYS),
        Collectives(None, 10.0),
        "127.0.0.1:1",
        retry_s,
    )


def _collector(stream: EpisodeStream, retry_s: float, max_staleness: int = 1) -> GroupCollector:
    checks = EntryChecks(32, 4, VersionSource(stream.client, KEYS).latest, dead_letter_maxlen=100)
    return GroupCollector(
        stream,
        "trainer-rank0",
        max_staleness=max_staleness,
        block_ms=50,
        already_done=set(),
        checks=checks,
        retry_s=retry_s,
    )


async def test_a_full_redis_refuses_writes_and_scripts_whole_and_lets_acks_trims_and_reads_through(
    redis_server: RedisServer,
) -> None:
    """The Redis semantics the trainer's backpressure rests on, checked on the real server: denyoom commands
    and the trainer's scripts (no shebang: refused at their first write) apply nothing; XACK, XTRIM, DEL, XREADGROUP
    and reads go through."""
    admin = redis.Redis(port=redis_server.port)
    admin.set("v", 7)
    admin.xgroup_create("s", "g", id="0", mkstream=True)
    entry = admin.xadd("s", {STREAM_FIELD: GARBAGE})
    second = admin.xadd("s", {STREAM_FIELD: GARBAGE})
    fill(redis_server)
    refused = []
    for write in (
        lambda: admin.incr("v"),
        lambda: admin.hset("h", "f", "1"),
        lambda: admin.xadd("s", {"f": "1"}),
        lambda: admin.set("k", "1"),
        lambda: admin.xgroup_create("s", "g", id="0"),
        lambda: admin.eval(OOM_SCRIPT, 1, "v"),
    ):
        try:
            write()
        except OutOfMemoryError:
            refused.append(True)

    async def dead_letter() -> type[BaseException] | None:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        try:
            await stream.read("c", 1, 0, pending_after=None)  # XREADGROUP: allowed
            await stream.dead_letter(entry.decode(), {STREAM_FIELD: GARBAGE}, "bad", 0, 100)
        except OutOfMemoryError as exc:
            return type(exc)
        finally:
            await stream.close()
        return None

    assert refused == [True] * 6
    assert await dead_letter() is OutOfMemoryError
    assert admin.get("v") == b"7"  # the refused script did not INCR
    assert admin.xlen(KEYS.dead_letter) == 0 and admin.hlen(KEYS.invalid) == 0  # nothing of the dead letter
    assert admin.xpending("s", "g")["pending"] == 1  # ... not even its XACK
    assert admin.xack("s", "g", entry) == 1  # XACK, XTRIM, DEL and reads go through
    assert admin.xtrim("s", minid=second.decode(), approximate=False) == 1
    assert admin.get("v") == b"7" and admin.delete("nothing") == 0


async def test_version_allocation_on_a_full_redis_waits_counts_and_takes_the_next_version_once_memory_frees(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis.Redis(port=redis_server.port)
    admin.set("v", 3)

    async def go() -> dict[str, Any]:
        client = EpisodeStream.from_url(redis_server.url, "s", "g").client
        publication = _publication(client, retry_s=30.0)
        oom = publication.backpressure
        fill(redis_server)
        allocate = asyncio.create_task(publication._allocate(policy_step=5, floor=0))
        assert await until(lambda: oom.retries >= 3)
        during = {
            "done": allocate.done(),
            "full": oom.full,
            "counter": admin.get("v"),
            "versions": admin.hgetall(KEYS.versions),
        }
        admin.delete("filler")
        version = await asyncio.wait_for(allocate, 20)
        await client.aclose()
        return {
            "during": during,
            "version": version,
            "full": oom.full,
            "episodes": oom.episodes,
            "retries": oom.retries,
        }

    with caplog.at_level(logging.INFO, logger="relayrl.common.retry"):
        seen = await go()

    assert seen["during"] == {"done": False, "full": True, "counter": b"3", "versions": {}}
    assert seen["version"] == 4 and admin.get("v") == b"4"  # the next version, allocated once
    assert json.loads(admin.hget(KEYS.versions, "4")) == [4, 5]
    assert json.loads(admin.hget(KEYS.lineages, "4")) == [0, 5]
    assert seen["full"] is False and seen["episodes"] == 1 and seen["retries"] >= 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "redis.retry_s" in warnings[0].getMessage()  # once per episode, not per retry
    assert sum("accepts writes again" in r.getMessage() for r in caplog.records) == 1


class _FillsAfterAllocating(VersionSource):
    """Redis fills between the allocation and the registration of a version."""

    def __init__(self, client: Any, server: RedisServer) -> None:
        super().__init__(client, KEYS)
        self.server = server
        self.calls = 0

    async def allocate(self, floor: int = 0) -> int:
        self.calls += 1
        version = await super().allocate(floor)
        fill(self.server)
        return version


async def test_a_registration_refused_by_a_full_redis_is_retried_for_the_version_already_allocated(
    redis_server: RedisServer,
) -> None:
    admin = redis.Redis(port=redis_server.port)

    async def go() -> dict[str, Any]:
        client = EpisodeStream.from_url(redis_server.url, "s", "g").client
        versions = _FillsAfterAllocating(client, redis_server)
        publication = _publication(client, retry_s=30.0, versions=versions)
        allocate = asyncio.create_task(publication._allocate(policy_step=0, floor=0))
        assert await until(lambda: publication.backpressure.retries >= 2)
        during = (allocate.done(), admin.get("v"), admin.hlen(KEYS.versions), admin.hlen(KEYS.lineages))
        admin.delete("filler")
        version = await asyncio.wait_for(allocate, 20)
        await client.aclose()
        return {"during": during, "version": version, "allocations": versions.calls, "lineage": publication.lineage}

    seen = await go()

    assert seen["during"] == (False, b"1", 0, 0)
    assert seen["version"] == 1 and seen["allocations"] == 1 and admin.get("v") == b"1"  # never allocated twice
    assert json.loads(admin.hget(KEYS.versions, "1")) == [1, 0]
    assert json.loads(admin.hget(KEYS.lineages, "1")) == [0, 0]  # the lineage record is retried too
    assert seen["lineage"] == 1


async def test_a_dead_letter_on_a_full_redis_waits_and_moves_the_entry_exactly_once_when_memory_frees(
    redis_server: RedisServer,
) -> None:
    admin = redis.Redis(port=redis_server.port)
    admin.set("v", 1)

    async def go() -> dict[str, Any]:
        stream = EpisodeStream(EpisodeStream.from_url(redis_server.url, "s", "g").client, KEYS)
        await stream.ensure_group()
        bad = await stream.client.xadd("s", {STREAM_FIELD: GARBAGE})
        await stream.append(_group("good"))
        collector = _collector(stream, retry_s=30.0)
        fill(redis_server)
        collect = asyncio.create_task(collector.collect(1, lambda v: asyncio.sleep(0, 0)))
        assert await until(lambda: collector.backpressure.retries >= 2)
        during = (
            collect.done(),
            admin.xlen(KEYS.dead_letter),
            admin.hlen(KEYS.invalid),
            admin.xpending("s", "g")["pending"],
            collector.backpressure.full,
        )
        admin.delete("filler")
        taken = await asyncio.wait_for(collect, 20)
        await stream.close()
        return {"during": during, "taken": [e.group_id for e in taken], "bad": bad.decode()}

    seen = await go()

    assert seen["during"] == (False, 0, 0, 1, True)  # nothing moved, counted or acknowledged while full
    assert seen["taken"] == ["good"]
    dead = admin.xrange(KEYS.dead_letter)
    assert len(dead) == 1 and dead[0][1][b"entry_id"].decode() == seen["bad"]
    assert admin.hgetall(KEYS.invalid) == {seen["bad"].encode(): b"0"}
    assert admin.xpending("s", "g")["pending"] == 1  # the good group waits for its checkpoint


async def test_a_drop_record_on_a_full_redis_waits_and_the_group_is_consumed_only_once_it_is_recorded(
    redis_server: RedisServer,
) -> None:
    admin = redis.Redis(port=redis_server.port)
    admin.set("v", 5)

    async def go() -> dict[str, Any]:
        stream = EpisodeStream(EpisodeStream.from_url(redis_server.url, "s", "g").client, KEYS)
        await stream.ensure_group()
        await stream.append(_group("stale", version=1))
        await stream.append(_group("fresh", version=5))
        collector = _collector(stream, retry_s=30.0, max_staleness=1)
        fill(redis_server)

        async def staleness(version: int) -> int:
            return 5 - version

        collect = asyncio.create_task(collector.collect(1, staleness))
        assert await until(lambda: collector.backpressure.retries >= 2)
        during = (collect.done(), admin.hlen(KEYS.dropped("stale")), list(collector.consumed_ids))
        admin.delete("filler")
        taken = await asyncio.wait_for(collect, 20)
        await stream.close()
        return {"during": during, "taken": [e.group_id for e in taken], "consumed": collector.consumed_ids}

    seen = await go()

    assert seen["during"] == (False, 0, [])
    assert seen["taken"] == ["fresh"]
    assert admin.hgetall(KEYS.dropped("stale")) == {b"stale": b"2"}
    assert seen["consumed"] == ["stale"]


async def test_consumer_group_creation_on_a_full_redis_waits_until_memory_frees(redis_server: RedisServer) -> None:
    admin = redis.Redis(port=redis_server.port)

    async def go() -> tuple[bool, list[Any]]:
        stream = EpisodeStream(EpisodeStream.from_url(redis_server.url, "s", "g").client, KEYS)
        collector = _collector(stream, retry_s=30.0)
        fill(redis_server)
        create = asyncio.create_task(collector.ensure_group())
        assert await until(lambda: collector.backpressure.retries >= 2)
        done = create.done()
        admin.delete("filler")
        await asyncio.wait_for(create, 20)
        await stream.close()
        return done, admin.xinfo_groups("s")

    done, groups = await go()

    assert done is False
    assert [g["name"] for g in groups] == [b"g"]


@pytest.mark.parametrize("write", ["version allocation", "dead letter"])
async def test_a_trainer_write_on_a_redis_that_stays_full_fails_after_redis_retry_s_naming_the_bound(
    redis_server: RedisServer, write: str
) -> None:
    admin = redis.Redis(port=redis_server.port)
    admin.set("v", 2)

    async def go() -> tuple[str, OomBackpressure]:
        stream = EpisodeStream(EpisodeStream.from_url(redis_server.url, "s", "g").client, KEYS)
        await stream.ensure_group()
        await stream.client.xadd("s", {STREAM_FIELD: GARBAGE})
        publication, collector = _publication(stream.client, retry_s=0.5), _collector(stream, retry_s=0.5)
        fill(redis_server)
        try:
            if write == "version allocation":
                await asyncio.wait_for(publication._allocate(1, 0), 10)
            else:
                await asyncio.wait_for(collector.collect(1, lambda v: asyncio.sleep(0, 0)), 10)
        except OutOfMemoryError as exc:
            return str(exc), publication.backpressure if write == "version allocation" else collector.backpressure
        finally:
            await stream.close()
        raise AssertionError("the write went through a full Redis")

    message, oom = await go()

    assert f"{write} was refused" in message and "redis.retry_s = 0.5s" in message
    assert oom.retries >= 1 and oom.full is False
    assert admin.get("v") == b"2" and admin.hlen(KEYS.versions) == 0  # nothing half written
    assert admin.xlen(KEYS.dead_letter) == 0 and admin.hlen(KEYS.invalid) == 0
