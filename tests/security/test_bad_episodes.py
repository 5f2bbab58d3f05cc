"""Bad entries in the episode stream (anyone holding the Redis credentials, or a buggy producer, can write one):
each is moved to the dead-letter stream and counted, never trained, and never stops or crash-loops the trainer.

The trainer's reading side is exercised for real: a GroupCollector on a real redis-server, with the real version
counter and lineage. Before this defence an undecodable entry raised out of every read (again after each
restart), a group with short logprobs reached the optimizer, and a version from the future passed the staleness
filter with a negative staleness."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.message import DecodeError

from relayrl.common.pb.episode_pb2 import Episode, EpisodeGroup
from relayrl.common.redis_keys import STREAM_FIELD, RedisKeys
from relayrl.common.stream import EpisodeStream, StreamEntry
from relayrl.trainer.groups import EntryChecks, GroupCollector
from relayrl.trainer.versions import VersionLineage, VersionSource
from tests.conftest import RedisServer

pytestmark = [pytest.mark.security, pytest.mark.integration]

VOCAB, MAX_TOKENS = 32, 4
GARBAGE = b"\xff\xff\xff\xff"  # a truncated varint: no protobuf parser accepts it
KEYS = RedisKeys(stream="s", group="g")


def _group(gid: str, version: int = 1) -> EpisodeGroup:
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
                sampling_temperature=1.0,
            )
            for i in range(2)
        ],
    )


class _Trainer:
    """The stream, version counter and lineage of a trainer serving ``current``, and its collector."""

    def __init__(self, url: str, current: int = 1) -> None:
        self.stream = EpisodeStream.from_url(url, KEYS.stream, KEYS.group)
        self.lineage = VersionLineage(self.stream.client, KEYS)
        self.current = current
        checks = EntryChecks(VOCAB, MAX_TOKENS, VersionSource(self.stream.client, KEYS).latest, dead_letter_maxlen=100)
        self.collector = GroupCollector(
            self.stream, "trainer-rank0", max_staleness=1, block_ms=50, already_done=set(), checks=checks, retry_s=5.0
        )

    async def staleness(self, version: int) -> int:
        return await self.lineage.distance(self.current, version)

    async def collect(self, n: int) -> list[str]:
        entries = await asyncio.wait_for(self.collector.collect(n, self.staleness), timeout=10)
        return [e.group_id for e in entries]

    async def dead(self) -> list[dict[bytes, bytes]]:
        return [fields for _id, fields in await self.stream.client.xrange(KEYS.dead_letter, "-", "+")]

    async def close(self) -> None:
        await self.stream.close()


async def _setup(url: str, counter: int = 1) -> _Trainer:
    trainer = _Trainer(url)
    await trainer.stream.ensure_group()
    await trainer.stream.client.set(KEYS.version_counter, counter)
    await trainer.lineage.register_lineage(1, 0, 0)
    await trainer.lineage.register(1, 1, 0)
    return trainer


async def test_an_undecodable_entry_is_dead_lettered_and_counted_and_the_trainer_keeps_reading(
    redis_server: RedisServer,
) -> None:
    with pytest.raises(DecodeError):  # what the old reader did with it, on every read and every restart
        EpisodeGroup.FromString(GARBAGE)

    async def go() -> dict[str, Any]:
        t = await _setup(redis_server.url)
        await t.stream.client.xadd(KEYS.stream, {STREAM_FIELD: GARBAGE})
        await t.stream.client.xadd(KEYS.stream, {b"not-a-group": b"1"})
        await t.stream.append(_group("ok"))
        out = {
            "trained": await t.collect(1),
            "dead": await t.dead(),
            "invalid": await t.stream.invalid(),
            "pending": (await t.stream.info()).pending,
        }
        await t.close()
        return out

    out = await go()

    assert out["trained"] == ["ok"]
    reasons = [d[b"reason"].split(b":")[0] for d in out["dead"]]
    assert reasons == [b"'group' is not an EpisodeGroup", b"no 'group' field"]
    assert out["dead"][0][STREAM_FIELD] == GARBAGE  # the original bytes, for inspection
    assert out["invalid"] == (2, 0)  # counted (groups, episodes); neither entry is pending any more
    assert out["pending"] == 1  # only the good group, acknowledged at the next checkpoint


async def test_a_trainer_that_died_on_a_bad_entry_restarts_past_it(redis_server: RedisServer) -> None:
    async def go() -> dict[str, Any]:
        t = await _setup(redis_server.url)
        await t.stream.client.xadd(KEYS.stream, {STREAM_FIELD: GARBAGE})
        await t.stream.append(_group("ok"))
        # the previous incarnation received both entries and died decoding the first: both are its pending entries
        await t.stream.client.xreadgroup(KEYS.group, "trainer-rank0", {KEYS.stream: ">"}, count=10)
        await t.close()
        first, second = _Trainer(redis_server.url), _Trainer(redis_server.url)
        out = {"first": await first.collect(1)}
        await first.close()
        await second.stream.append(_group("next"))
        out["second"] = await second.collect(1)  # a second restart: the bad entry is gone, not read again
        out["dead"], out["invalid"] = len(await second.dead()), await second.stream.invalid()
        await second.close()
        return out

    out = await go()

    assert out["first"] == ["ok"]
    assert out["second"] == ["ok"]  # still pending (no checkpoint yet): read again; the bad entry is not
    assert out["dead"] == 1 and out["invalid"] == (1, 0)


def _short_logprobs(g: EpisodeGroup) -> None:
    del g.episodes[0].behaviour_logprobs[-1]


def _token_outside_vocab(g: EpisodeGroup) -> None:
    g.episodes[1].completion_token_ids[0] = VOCAB


def _version_from_the_future(g: EpisodeGroup) -> None:
    g.episodes[0].token_weight_versions[1] = 10**12


def _nan_reward(g: EpisodeGroup) -> None:
    g.episodes[1].reward = math.nan


def _too_long(g: EpisodeGroup) -> None:
    for field, value in (
        ("completion_token_ids", 3),
        ("behaviour_logprobs", -1.0),
        ("token_weight_versions", 1),
        ("loss_mask", 1),
    ):
        getattr(g.episodes[0], field).extend([value] * MAX_TOKENS)


@pytest.mark.parametrize(
    ("attack", "field"),
    [
        (_short_logprobs, b"behaviour_logprobs"),
        (_token_outside_vocab, b"completion_token_ids"),
        (_version_from_the_future, b"token_weight_versions"),
        (_nan_reward, b"reward"),
        (_too_long, b"completion_token_ids"),
    ],
)
async def test_a_group_that_breaks_an_invariant_is_never_trained_but_dead_lettered_with_its_reason(
    redis_server: RedisServer, attack: Callable[[EpisodeGroup], None], field: bytes
) -> None:
    async def go() -> dict[str, Any]:
        t = await _setup(redis_server.url)
        bad = _group("bad")
        attack(bad)
        await t.stream.append(bad)
        await t.stream.append(_group("ok"))
        out = {"trained": await t.collect(1), "dead": await t.dead(), "invalid": await t.stream.invalid()}
        await t.close()
        return out

    out = await go()

    assert out["trained"] == ["ok"]
    [dead] = out["dead"]
    assert field in dead[b"reason"]
    assert EpisodeGroup.FromString(dead[STREAM_FIELD]).group_id == "bad"
    assert out["invalid"] == (1, 2)


async def test_a_version_ahead_of_the_trainers_weights_is_refused_not_given_a_negative_staleness(
    redis_server: RedisServer,
) -> None:
    async def go() -> dict[str, Any]:
        t = await _setup(redis_server.url, counter=10)  # versions up to 10 were allocated ...
        t.current = 5  # ... the trainer's weights are version 5; version 7 has no lineage record
        await t.lineage.register(5, 1, 4)
        out: dict[str, Any] = {"distance": await t.staleness(7)}
        await t.stream.append(_group("ahead", version=7))
        await t.stream.append(_group("ok", version=5))
        out |= {"trained": await t.collect(1), "dead": await t.dead()}
        await t.close()
        return out

    out = await go()

    assert out["distance"] == -2  # what the old filter compared with max_staleness (and let through)
    assert out["trained"] == ["ok"]
    [dead] = out["dead"]
    assert b"token_weight_versions" in dead[b"reason"] and b"staleness -2" in dead[b"reason"]


async def test_the_collectors_ready_entries_are_only_decoded_valid_groups(redis_server: RedisServer) -> None:
    """Whatever mix of entries arrives, what collect returns is exactly the valid groups, in order."""

    async def go() -> list[StreamEntry]:
        t = await _setup(redis_server.url)
        for i in range(6):
            if i % 2:
                await t.stream.client.xadd(KEYS.stream, {STREAM_FIELD: GARBAGE[: i % 4 + 1]})
            await t.stream.append(_group(f"g{i}"))
        entries = await asyncio.wait_for(t.collector.collect(6, t.staleness), timeout=10)
        await t.close()
        return entries

    entries = await go()

    assert [e.group_id for e in entries] == [f"g{i}" for i in range(6)]


async def test_a_version_the_trainer_allocated_is_accepted_without_reading_the_counter_and_a_newer_one_is_refused(
    redis_server: RedisServer,
) -> None:
    """The collector learns each version the trainer publishes (GroupCollector.allocated): the step's groups of
    that version need no read of the counter on their way to the batch; a version beyond the counter still gets
    one and is dead-lettered."""

    async def go() -> dict[str, Any]:
        t = await _setup(redis_server.url, counter=3)
        t.current = 3
        for v in (2, 3):
            await t.lineage.register(v, 1, v - 1)
        reads: list[int] = []
        counter = t.collector.checks.newest_version

        async def counted() -> int:
            reads.append(await counter())
            return reads[-1]

        t.collector.checks = dataclasses.replace(t.collector.checks, newest_version=counted)
        t.collector.allocated(3)
        await t.stream.append(_group("published", version=3))
        out: dict[str, Any] = {"trained": await t.collect(1), "reads": list(reads)}
        await t.stream.append(_group("future", version=4))
        await t.stream.append(_group("ok", version=3))
        out |= {"then": await t.collect(1), "reads_then": list(reads), "dead": await t.dead()}
        await t.close()
        return out

    out = await go()

    assert out["trained"] == ["published"] and out["reads"] == []
    assert out["then"] == ["ok"] and out["reads_then"] == [3]  # version 4 asked the counter, which says 3
    [dead] = out["dead"]
    assert b"newer than the newest allocated 3" in dead[b"reason"]
