"""A batch read while the step before it computes (relayrl.trainer.loop reads ahead): the collector counts each
group's staleness from the weights that will train it, ``steps_ahead()`` steps past the current ones, asked at each
judgement, on a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from relayrl.common.pb.episode_pb2 import Episode, EpisodeGroup
from relayrl.common.redis_keys import RedisKeys
from relayrl.common.stream import EpisodeStream
from relayrl.trainer.groups import EntryChecks, GroupCollector
from relayrl.trainer.versions import VersionLineage, VersionSource
from tests.conftest import RedisServer

pytestmark = pytest.mark.integration

KEYS = RedisKeys(stream="s", group="g")


def _group(gid: str, version: int) -> EpisodeGroup:
    return EpisodeGroup(
        group_id=gid,
        episodes=[
            Episode(
                episode_id=f"{gid}-{i}",
                group_id=gid,
                sample_index=i,
                group_size=2,
                prompt_token_ids=[1, 2],
                completion_token_ids=[3, 4],
                behaviour_logprobs=[-0.5, -1.0],
                token_weight_versions=[version, version],
                loss_mask=[1, 1],
                reward=float(i),
            )
            for i in range(2)
        ],
    )


class Weights:
    """The trainer's current version and its policy step, as the publication holds them (versions 1, 2, 3 are
    policy steps 0, 1, 2 of one lineage)."""

    def __init__(self, stream: EpisodeStream) -> None:
        self.lineage = VersionLineage(stream.client, KEYS)
        self.version = 2

    async def register(self) -> None:
        await self.lineage.register_lineage(1, 0, 0)
        for v in (1, 2, 3):
            await self.lineage.register(v, 1, v - 1)

    async def staleness(self, token_version: int) -> int:
        current = self.version  # read at the call, as VersionPublication.staleness does
        return await self.lineage.distance(current, token_version)

    def ahead_of(self, step: int) -> Callable[[], int]:
        """The loop's steps_ahead for a batch of step ``step`` (trained by the weights of policy step step - 1)."""
        return lambda: step - 1 - (self.version - 1)


async def _collector(url: str) -> tuple[EpisodeStream, GroupCollector, Weights]:
    stream = EpisodeStream.from_url(url, KEYS.stream, KEYS.group)
    await stream.ensure_group()
    await stream.client.set(KEYS.version_counter, 3)
    weights = Weights(stream)
    await weights.register()
    checks = EntryChecks(32, 4, VersionSource(stream.client, KEYS).latest, dead_letter_maxlen=100)
    collector = GroupCollector(stream, "trainer-rank0", 1, 50, set(), checks, retry_s=5.0)
    return stream, collector, weights


async def test_a_group_read_ahead_counts_its_staleness_from_the_version_the_computing_step_will_publish(
    redis_server: RedisServer,
) -> None:
    """Weights at policy step 1 (version 2); step 2 computes, the read is for step 3. A group of version 1 is one
    step behind now but two behind the weights that will train it: beyond max_staleness 1, dropped and counted.
    The same group read for step 2 (nothing ahead) is trained."""
    stream, collector, weights = await _collector(redis_server.url)
    try:
        for gid, version in (("old", 1), ("fresh", 2)):
            await stream.append(_group(gid, version))
        taken = await asyncio.wait_for(collector.collect(1, weights.staleness, weights.ahead_of(3)), 10)
        stale = await stream.client.hgetall(KEYS.dropped("stale"))
        await stream.append(_group("old-again", 1))
        now = await asyncio.wait_for(collector.collect(1, weights.staleness, weights.ahead_of(2)), 10)
    finally:
        await stream.close()

    assert [ing.group_id for ing in taken] == ["fresh"]
    assert list(stale) == [b"old"]  # recorded in Redis: the books count it
    assert [ing.group_id for ing in now] == ["old-again"]


async def test_a_read_ahead_that_waits_past_the_publication_counts_from_the_new_weights_once(
    redis_server: RedisServer,
) -> None:
    """The read for step 3 starts while step 2 computes and waits for groups; step 2 publishes version 3 meanwhile.
    A group of version 2 arriving after that is one step behind the weights that train it, not two: the steps
    ahead are asked at the judgement, not fixed when the read began."""
    stream, collector, weights = await _collector(redis_server.url)
    try:
        reading = asyncio.create_task(collector.collect(1, weights.staleness, weights.ahead_of(3)))
        await asyncio.sleep(0)  # the read is under way (blocked on the empty stream)
        weights.version = 3  # step 2 published
        await stream.append(_group("after-publication", 2))
        taken = await asyncio.wait_for(reading, 10)
        stale = await stream.client.hlen(KEYS.dropped("stale"))
    finally:
        await stream.close()

    assert [ing.group_id for ing in taken] == ["after-publication"] and stale == 0
