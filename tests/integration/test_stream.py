"""The episode stream against a real redis-server."""

from __future__ import annotations

import time

import pytest
import redis

from relayrl.common.pb.episode_pb2 import Episode, EpisodeGroup
from relayrl.common.redis_keys import STREAM_FIELD, trainer_consumer
from relayrl.common.stream import Books, EpisodeStream
from tests.conftest import RedisServer

pytestmark = pytest.mark.integration


def _group(group: str, n: int) -> EpisodeGroup:
    return EpisodeGroup(
        group_id=group,
        episodes=[Episode(episode_id=f"{group}-{i}", group_id=group, sample_index=i, group_size=n) for i in range(n)],
    )


async def test_appended_groups_are_read_whole_in_order_and_acked(redis_server: RedisServer) -> None:
    async def go() -> None:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        await stream.ensure_group()
        await stream.ensure_group()  # idempotent

        await stream.append(_group("a", 3))
        await stream.append(_group("b", 3))
        entries = await stream.read("c1", count=10, block_ms=100)
        info_before = await stream.info()
        acked = await stream.ack([e.entry_id for e in entries])
        info_after = await stream.info()
        await stream.close()

        assert [e.group.group_id for e in entries] == ["a", "b"]  # type: ignore[union-attr]
        assert [ep.episode_id for ep in entries[0].group.episodes] == ["a-0", "a-1", "a-2"]
        assert (info_before.pending, info_before.lag) == (2, 0)
        assert acked == 2 and info_after.pending == 0 and info_after.length == 2  # never trimmed

    await go()


async def test_queue_depth_counts_unread_and_unacknowledged_groups(redis_server: RedisServer) -> None:
    async def go() -> list[tuple[int | None, int]]:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        await stream.ensure_group()
        depths = [await stream.queue_depth()]
        for name in "abcd":
            await stream.append(_group(name, 2))
        depths.append(await stream.queue_depth())
        entries = await stream.read("c1", count=3, block_ms=100)
        depths.append(await stream.queue_depth())
        await stream.ack([entries[0].entry_id])
        depths.append(await stream.queue_depth())
        await stream.close()
        return depths

    assert await go() == [(0, 0), (4, 0), (1, 3), (1, 2)]


async def test_books_read_every_count_and_the_queue_depth_in_one_round_trip_as_the_single_reads_do(
    redis_server: RedisServer,
) -> None:
    async def go() -> tuple[Books, Books, list[object]]:
        stream = EpisodeStream.from_url(redis_server.url, "books", "g")
        before = await stream.books()  # no stream, no group, no drops yet
        await stream.ensure_group()
        for name in "abc":
            await stream.append(_group(name, 2))
        entries = await stream.read("c1", count=2, block_ms=100)
        await stream.record_dropped("x", 4)
        await stream.record_dropped("y", 3)
        await stream.record_dropped("z", 5, "reward_error")
        await stream.dead_letter(entries[0].entry_id, entries[0].fields, "invalid", 2, 100)
        after = await stream.books()
        single = [
            await stream.dropped(),
            await stream.dropped("reward_error"),
            await stream.dropped("zero_advantage"),
            await stream.invalid(),
            await stream.queue_depth(),
        ]
        await stream.close()
        return before, after, single

    before, after, single = await go()

    assert before == Books(
        dropped={r: (0, 0) for r in ("stale", "reward_error", "zero_advantage")}, invalid=(0, 0), lag=None, pending=0
    )
    assert after.dropped == {"stale": (2, 7), "reward_error": (1, 5), "zero_advantage": (0, 0)}
    assert after.invalid == (1, 2) and (after.lag, after.pending) == (1, 1)
    assert single == [
        after.dropped["stale"],
        after.dropped["reward_error"],
        after.dropped["zero_advantage"],
        after.invalid,
        (after.lag, after.pending),
    ]


def _until_aof_written(url: str, attempts: int = 200) -> None:
    """Wait until Redis has written its AOF buffer to the file (``aof_buffer_length`` 0 in INFO persistence):
    from then on the entries survive a kill of the process (the OS holds the written bytes)."""
    client = redis.Redis.from_url(url)
    try:
        for _ in range(attempts):
            info = client.info("persistence")
            if info["aof_enabled"] and info["aof_buffer_length"] == 0 and not info["aof_rewrite_in_progress"]:
                return
            time.sleep(0.01)
    finally:
        client.close()
    raise AssertionError("Redis did not write its AOF buffer")


async def test_unacked_entries_are_redelivered_to_the_same_consumer_after_a_redis_kill(
    redis_server: RedisServer,
) -> None:
    async def produce_and_read() -> None:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        await stream.ensure_group()
        for name in "abc":
            await stream.append(_group(name, 2))
        await stream.read("c1", count=10, block_ms=100)  # delivered, never acked
        await stream.close()

    async def reread() -> tuple[list[str], list[str], list[str]]:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        first = await stream.read("c1", count=2, block_ms=100, pending_after="0")
        rest = await stream.read("c1", count=2, block_ms=100, pending_after=first[-1].entry_id)
        new = await stream.read("c1", count=10, block_ms=100)
        await stream.close()
        return [e.group.group_id for e in first], [e.group.group_id for e in rest], [e.group.group_id for e in new]

    await produce_and_read()
    _until_aof_written(redis_server.url)  # a kill -9 of the process loses nothing written to the AOF file
    redis_server.stop(kill=True)
    redis_server.start()
    first, rest, new = await reread()

    assert (first, rest) == (["a", "b"], ["c"])  # AOF kept the entries and the pending list; paged reads
    assert new == []


async def test_pending_entries_of_a_gone_consumer_are_claimed(redis_server: RedisServer) -> None:
    async def go() -> tuple[int, list[str]]:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        await stream.ensure_group()
        for name in "ab":
            await stream.append(_group(name, 1))
        rank0, rank1 = trainer_consumer("trainer", 0), trainer_consumer("trainer", 1)
        await stream.read(rank1, count=10, block_ms=100)  # rank 1 of an earlier, larger run
        claimed = await stream.claim_from_gone_consumers(rank0, live={rank0})
        mine = await stream.read(rank0, count=10, block_ms=100, pending_after="0")
        await stream.close()
        return claimed, [e.group.group_id for e in mine]

    claimed, mine = await go()

    assert claimed == 2 and mine == ["a", "b"]


async def test_lineage_distance_counts_steps_across_a_resume_fork(redis_server: RedisServer) -> None:
    from relayrl.common.redis_keys import RedisKeys
    from relayrl.trainer.versions import VersionLineage

    async def go() -> list[int]:
        client = EpisodeStream.from_url(redis_server.url, "s", "g").client
        db = VersionLineage(client, RedisKeys(version_counter="v"))
        await db.register_lineage(1, 0, 0)  # first incarnation: versions 1..5 = steps 0..4
        for v in range(1, 6):
            await db.register(v, 1, v - 1)
        await db.register_lineage(6, 1, 2)  # resumed from the step-2 checkpoint: versions 6, 7 = steps 2, 3
        await db.register(6, 6, 2)
        await db.register(7, 6, 3)
        fresh = VersionLineage(client, RedisKeys(version_counter="v"))  # another rank: reads everything from Redis
        out = [
            await fresh.distance(7, 3),
            await fresh.distance(6, 3),
            await fresh.distance(7, 5),
            await fresh.distance(5, 2),
            await fresh.distance(7, 99),
        ]
        await client.aclose()
        return out

    same_history, restored, lost_branch, same_lineage, unknown = await go()

    assert same_history == 1  # version 3 (step 2) is an ancestor of version 7 (step 3)
    assert restored == 0  # version 6 republished the step-2 weights of version 3
    assert lost_branch == (3 - 2) + (4 - 2)  # version 5 (step 4) lies on the branch the resume discarded
    assert same_lineage == 3
    assert unknown == 7 - 99  # no record: plain version difference


async def test_queue_info_before_anything_was_appended_is_an_empty_queue(redis_server: RedisServer) -> None:
    async def go() -> tuple[int, int, int]:
        stream = EpisodeStream.from_url(redis_server.url, "never-written", "g")
        info = await stream.info()
        await stream.close()
        return info.length, info.lag, info.pending

    assert await go() == (0, 0, 0)


async def test_trimming_after_acks_keeps_every_pending_and_unread_entry_and_a_restart_rereads_the_pending(
    redis_server: RedisServer,
) -> None:
    async def go() -> dict[str, object]:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        await stream.ensure_group()
        for name in "abcdef":
            await stream.append(_group(name, 1))
        read = await stream.read("c1", count=4, block_ms=100)  # a..d delivered; e, f unread
        await stream.ack([read[0].entry_id, read[2].entry_id])  # a, c acked; b, d pending
        out: dict[str, object] = {"minid": await stream.trim_acked()}
        out["length_with_b_pending"] = (await stream.info()).length
        restarted = EpisodeStream.from_url(redis_server.url, "s", "g")  # a restarted trainer re-reads its pending
        out["reread"] = [
            e.group.group_id for e in await restarted.read("c1", count=10, block_ms=100, pending_after="0")
        ]
        await stream.ack([read[1].entry_id, read[3].entry_id])
        await stream.trim_acked()
        out["length_all_acked"] = (await stream.info()).length
        out["depth"] = await stream.queue_depth()
        out["unread"] = [e.group.group_id for e in await restarted.read("c1", count=10, block_ms=100)]
        await restarted.close()
        await stream.close()
        out["b_id"] = read[1].entry_id
        return out

    out = await go()

    assert out["minid"] == out["b_id"]  # the oldest pending entry bounds the trim
    assert out["length_with_b_pending"] == 5  # only a (acked, before b) went; c stays behind pending b
    assert out["reread"] == ["b", "d"]
    assert out["length_all_acked"] == 2  # e, f: never delivered, never trimmed
    assert out["depth"] == (2, 0)  # the group's lag survives the trim
    assert out["unread"] == ["e", "f"]


async def test_trimming_waits_for_every_consumer_group(redis_server: RedisServer) -> None:
    async def go() -> tuple[str | None, int]:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        await stream.ensure_group()
        await stream.client.xgroup_create("s", "audit", id="0")  # another reader that has read nothing yet
        for name in "abc":
            await stream.append(_group(name, 1))
        await stream.ack([e.entry_id for e in await stream.read("c1", count=10, block_ms=100)])
        minid = await stream.trim_acked()
        length = (await stream.info()).length
        await stream.close()
        return minid, length

    assert await go() == (None, 3)


async def test_dead_letter_copies_counts_and_acks_an_entry_once_and_keeps_the_stream_bounded(
    redis_server: RedisServer,
) -> None:
    async def go() -> dict[str, object]:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        await stream.ensure_group()
        entry_id = (await stream.client.xadd("s", {STREAM_FIELD: b"\xff\x00garbage", b"extra": b"1"})).decode()
        [bad] = await stream.read("c1", count=10, block_ms=100)
        await stream.dead_letter(bad.entry_id, bad.fields, "not an EpisodeGroup", 0, maxlen=3)
        await stream.dead_letter(bad.entry_id, bad.fields, "not an EpisodeGroup", 0, maxlen=3)  # a retry
        out: dict[str, object] = {
            "dead": await stream.client.xrange(stream.keys.dead_letter, "-", "+"),
            "invalid": await stream.invalid(),
            "pending": (await stream.info()).pending,
            "entry_id": entry_id,
            "bad": bad,
        }
        for i in range(5):
            await stream.dead_letter(f"9-{i}", {STREAM_FIELD: b"x"}, "r", 1, maxlen=3)
        out["dead_length"] = await stream.client.xlen(stream.keys.dead_letter)
        out["invalid_after"] = await stream.invalid()
        await stream.close()
        return out

    out = await go()

    [(_, fields)] = out["dead"]  # type: ignore[misc]
    assert fields == {
        STREAM_FIELD: b"\xff\x00garbage",
        b"extra": b"1",
        b"reason": b"not an EpisodeGroup",
        b"entry_id": str(out["entry_id"]).encode(),
    }
    assert out["invalid"] == (1, 0) and out["pending"] == 0
    assert out["dead_length"] == 3  # capped at maxlen; the count is not
    assert out["invalid_after"] == (6, 5)


def test_the_summary_counts_every_entry_ever_added_even_after_trimming(redis_server: RedisServer) -> None:
    from relayrl.run_report import entries_added

    client = redis.Redis.from_url(redis_server.url)
    missing = entries_added(client, "s", fallback=7)
    for _ in range(3):
        last = client.xadd("s", {STREAM_FIELD: b""})
    client.xtrim("s", minid=last.decode(), approximate=False)  # type: ignore[union-attr]
    added, length = entries_added(client, "s", fallback=7), client.xlen("s")
    client.close()

    assert (missing, added, length) == (7, 3, 1)
