"""DAPO's dynamic sampling: zero-advantage groups are dropped, counted and replaced, within a bound.

The collector on a real redis-server (bound and counts), then rollout -> Redis -> trainer with every part real and a
reward that makes some prompts' groups uniform."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from relayrl.common.dataset import PromptCursor, open_prompts
from relayrl.common.pb.episode_pb2 import Episode, EpisodeGroup
from relayrl.common.redis_keys import STREAM_FIELD, RedisKeys
from relayrl.common.stream import EpisodeStream
from relayrl.trainer.groups import EntryChecks, GroupCollector
from relayrl.trainer.versions import VersionLineage, VersionSource
from tests.conftest import RedisServer
from tests.integration.stack import run_stack, stack_config

pytestmark = pytest.mark.integration

KEYS = RedisKeys(stream="s", group="g")


def _group(gid: str, rewards: list[float]) -> EpisodeGroup:
    return EpisodeGroup(
        group_id=gid,
        episodes=[
            Episode(
                episode_id=f"{gid}-{i}",
                group_id=gid,
                sample_index=i,
                group_size=len(rewards),
                prompt_token_ids=[1, 2],
                completion_token_ids=[3, 4],
                behaviour_logprobs=[-0.5, -1.0],
                token_weight_versions=[1, 1],
                loss_mask=[1, 1],
                reward=r,
                sampling_temperature=1.0,
            )
            for i, r in enumerate(rewards)
        ],
    )


async def _collect_from(
    url: str, groups: list[EpisodeGroup], n: int, ratio: float | None
) -> tuple[list[str], tuple[int, int], list[str]]:
    """Append ``groups``, collect ``n`` with dynamic sampling at ``ratio`` (None: off): (taken ids, drop counts,
    dropped ids)."""
    stream = EpisodeStream.from_url(url, KEYS.stream, KEYS.group)
    try:
        await stream.ensure_group()
        await stream.client.set(KEYS.version_counter, 1)
        lineage = VersionLineage(stream.client, KEYS)
        await lineage.register_lineage(1, 0, 0)
        await lineage.register(1, 1, 0)
        for g in groups:
            await stream.client.xadd(KEYS.stream, {STREAM_FIELD: g.SerializeToString()})
        checks = EntryChecks(32, 4, VersionSource(stream.client, KEYS).latest, dead_letter_maxlen=100)
        collector = GroupCollector(
            stream,
            "trainer-rank0",
            max_staleness=1,
            block_ms=50,
            already_done=set(),
            checks=checks,
            retry_s=5.0,
            zero_advantage_drop_ratio=ratio,
        )

        async def staleness(version: int) -> int:
            return await lineage.distance(1, version)

        taken = await asyncio.wait_for(collector.collect(n, staleness), timeout=10)
        dropped = sorted((await stream.client.hgetall(KEYS.dropped("zero_advantage"))).keys())
        return ([e.group_id for e in taken], await stream.dropped("zero_advantage"), [d.decode() for d in dropped])
    finally:
        await stream.close()


GROUPS = [
    _group("u1", [1.0, 1.0]),
    _group("i1", [0.0, 1.0]),
    _group("u2", [0.0, 0.0]),
    _group("u3", [0.5, 0.5]),
    _group("i2", [1.0, 0.0]),
]


async def test_zero_advantage_groups_are_dropped_counted_and_replaced_until_the_bound(
    redis_server: RedisServer,
) -> None:
    # ratio 1.0 x 2 groups asked: at most 2 drops in this collection; the third uniform group is trained
    taken, counts, dropped = await _collect_from(redis_server.url, GROUPS, 2, 1.0)

    assert taken == ["i1", "u3"]
    assert dropped == ["u1", "u2"]
    assert counts == (2, 4)  # (groups, episodes)


async def test_zero_advantage_groups_are_trained_when_dynamic_sampling_is_off(redis_server: RedisServer) -> None:
    taken, counts, dropped = await _collect_from(redis_server.url, GROUPS, 2, None)

    assert taken == ["u1", "i1"]
    assert (counts, dropped) == ((0, 0), [])


async def test_a_step_trains_only_informative_groups_rollout_fills_the_batch_and_the_books_balance(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    cfg = stack_config(
        tmp_path / "run",
        tiny_model_dir,
        dataset_path,
        redis_server.url,
        "rollout.max_staleness=1",
        "trainer.dynamic_sampling.enabled=true",
        "trainer.dynamic_sampling.max_drop_ratio=10",
    )

    out = await run_stack(cfg, tiny_model_dir, "tests.reward_fns:uniform_for_some_prompts")

    rows = out["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["episodes"] == 2 * 4 for r in rows)  # every step full: rollout produced replacements
    assert out["dropped_zero_advantage"] >= 1
    assert out["episodes_dropped_zero_advantage"] == 4 * out["dropped_zero_advantage"]
    assert rows[-1]["groups_dropped_zero_advantage"] == out["dropped_zero_advantage"]
    cursor = PromptCursor(open_prompts(cfg.rollout.dataset_spec()).train, True, 0)  # rollout's order (the same seed)
    audit = [json.loads(line) for line in (tmp_path / "run" / "trained" / "rank0.jsonl").read_text().splitlines()]
    trained_prompts = [cursor.at(seq).prompt for a in audit for _gid, seq in a["groups"]]
    assert len(trained_prompts) == 4 * 2
    assert not [p for p in trained_prompts if p[:1] in ("1", "3")]  # the uniform prompts never reach the loss
    assert out["produced"] == (
        out["trained"]
        + out["dropped"]
        + out["dropped_reward_error"]
        + out["dropped_zero_advantage"]
        + out["invalid"]
        + out["pending"]
    )
