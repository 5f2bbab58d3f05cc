"""The episode stream against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.common.pb.episode_pb2 import Episode
from relayrl.common.stream import EpisodeStream
from tests.conftest import RedisServer

pytestmark = pytest.mark.integration


def _episodes(group: str, n: int) -> list[Episode]:
    return [Episode(episode_id=f"{group}-{i}", group_id=group, sample_index=i, group_size=n) for i in range(n)]


def test_appended_group_is_read_in_order_and_acked(redis_server: RedisServer) -> None:
    async def go() -> None:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        await stream.ensure_group()
        await stream.ensure_group()  # idempotent

        ids = await stream.append(_episodes("a", 3))
        entries = await stream.read("c1", count=10, block_ms=100)
        info_before = await stream.info()
        acked = await stream.ack([e.entry_id for e in entries])
        info_after = await stream.info()
        await stream.close()

        assert [e.entry_id for e in entries] == ids
        assert [e.episode.episode_id for e in entries] == ["a-0", "a-1", "a-2"]
        assert (info_before.pending, info_before.lag) == (3, 0)
        assert acked == 3 and info_after.pending == 0 and info_after.length == 3  # never trimmed

    asyncio.run(go())


def test_unacked_entries_are_redelivered_to_the_same_consumer_after_a_redis_restart(
        redis_server: RedisServer) -> None:
    async def produce_and_read() -> None:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        await stream.ensure_group()
        await stream.append(_episodes("a", 2))
        await stream.read("c1", count=10, block_ms=100)  # delivered, never acked
        await stream.close()

    async def reread() -> tuple[list[str], list[str]]:
        stream = EpisodeStream.from_url(redis_server.url, "s", "g")
        pending = await stream.read("c1", count=10, block_ms=100, pending=True)
        new = await stream.read("c1", count=10, block_ms=100)
        await stream.close()
        return [e.episode.episode_id for e in pending], [e.episode.episode_id for e in new]

    asyncio.run(produce_and_read())
    import time

    time.sleep(1.2)  # appendfsync everysec
    redis_server.stop(kill=True)
    redis_server.start()
    pending, new = asyncio.run(reread())

    assert pending == ["a-0", "a-1"]  # AOF kept both the entries and the pending list
    assert new == []
