"""Runs that share one redis-server: each keeps its own stream, books, dataset cursor and versions (the run's name in
every key), one after the other and at once; `relayrl runs` lists them and deletes one without touching the other."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis

from relayrl.cli import main
from relayrl.common.redis_keys import RedisKeys
from relayrl.config import RunConfig, dump_run_config
from tests.conftest import RedisServer
from tests.integration.stack import run_stack, stack_config

pytestmark = pytest.mark.integration


def _config(tmp: Path, name: str, model: Path, data: Path, url: str) -> RunConfig:
    return stack_config(tmp / name, model, data, url, f"name={name}")


def _state(client: redis.Redis, keys: RedisKeys) -> dict[str, Any]:
    """What a run keeps in Redis besides its stream: the dataset cursor and counts, the versions it allocated."""
    return {
        "rollout": client.hgetall(keys.rollout_progress),
        "counter": client.get(keys.version_counter),
        "versions": client.hlen(keys.versions),
    }


def _books_add_up(result: dict[str, Any]) -> bool:
    dropped = result["dropped"] + result["dropped_reward_error"] + result["dropped_zero_advantage"]
    return bool(result["produced"] == result["trained"] + dropped + result["invalid"] + result["pending"])


async def test_a_second_run_on_the_same_redis_starts_clean_and_leaves_the_first_runs_state_alone(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    """Before run names keyed Redis, the second run read the first's `appended` count and dataset cursor into its
    admission and continued its version counter."""
    first_cfg = _config(tmp_path, "first", tiny_model_dir, dataset_path, redis_server.url)
    second_cfg = _config(tmp_path, "second", tiny_model_dir, dataset_path, redis_server.url)
    client = redis.Redis(port=redis_server.port)
    first = await run_stack(first_cfg, tiny_model_dir, timeout_s=90)
    first_keys = RedisKeys.from_config(first_cfg.redis, "first")
    before = _state(client, first_keys)

    second = await run_stack(second_cfg, tiny_model_dir, timeout_s=90)

    assert _state(client, first_keys) == before
    assert [r["step"] for r in second["rows"]] == [1, 2, 3, 4] and _books_add_up(second) and _books_add_up(first)
    # its own counter: the versions it published are the same as the first run's, allocated afresh
    assert [r["weight_version"] for r in second["rows"]] == [r["weight_version"] for r in first["rows"]]
    second_keys = RedisKeys.from_config(second_cfg.redis, "second")
    cursor = int(client.hget(second_keys.rollout_progress, "appended") or 0)
    assert cursor == second["produced"]  # its cursor counts its own groups only


async def test_two_runs_at_once_on_one_redis_each_learn_and_keep_their_own_books(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    cfgs = [_config(tmp_path, name, tiny_model_dir, dataset_path, redis_server.url) for name in ("left", "right")]

    results = await asyncio.gather(*(run_stack(cfg, tiny_model_dir, timeout_s=120) for cfg in cfgs))

    client = redis.Redis(port=redis_server.port)
    for cfg, result in zip(cfgs, results, strict=True):
        keys = RedisKeys.from_config(cfg.redis, cfg.name)
        assert [r["step"] for r in result["rows"]] == [1, 2, 3, 4] and _books_add_up(result)
        assert int(client.hget(keys.rollout_progress, "appended") or 0) == result["produced"]
        assert int(client.get(keys.version_counter) or 0) == max(r["weight_version"] for r in result["rows"])


async def test_relayrl_runs_lists_the_runs_of_a_redis_and_deletes_one_keeping_its_version_counter(
    tmp_path: Path,
    tiny_model_dir: Path,
    dataset_path: Path,
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfgs = [_config(tmp_path, name, tiny_model_dir, dataset_path, redis_server.url) for name in ("old", "kept")]
    results = [await run_stack(cfg, tiny_model_dir, timeout_s=90) for cfg in cfgs]
    config_file = tmp_path / "run.yaml"
    dump_run_config(cfgs[1], config_file)
    client = redis.Redis(port=redis_server.port)
    old, kept = (RedisKeys.from_config(cfg.redis, cfg.name) for cfg in cfgs)
    kept_state = {key: client.dump(key) for key in kept.state() if client.exists(key)}
    capsys.readouterr()

    assert await asyncio.to_thread(main, ["runs", "list", str(config_file)]) == 0
    listed = capsys.readouterr().out
    assert "old" in listed and "kept" in listed
    assert await asyncio.to_thread(main, ["runs", "delete", str(config_file), "old"]) == 2  # without --yes
    assert client.exists(old.stream)

    assert await asyncio.to_thread(main, ["runs", "delete", str(config_file), "old", "--yes"]) == 0

    assert not any(client.exists(key) for key in old.state())
    last = max(r["weight_version"] for r in results[0]["rows"])
    assert int(client.get(old.version_counter) or 0) == last  # a later run named old continues after it
    assert {key: client.dump(key) for key in kept.state() if client.exists(key)} == kept_state
    assert await asyncio.to_thread(main, ["runs", "list", str(config_file)]) == 0
    assert "kept" in capsys.readouterr().out
