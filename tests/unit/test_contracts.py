"""One place per contract: Redis key names (relayrl.common.redis_keys), the metrics row
(relayrl.common.metrics_row) and the retry policies of the typed clients (relayrl.client)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from relayrl.client import NO_RETRY, InferenceClient, RetryPolicy
from relayrl.common.metrics_row import MetricsRow, RlRow, SftRow, parse_line, parse_row, read_rows
from relayrl.common.redis_keys import RedisKeys, trainer_consumer
from relayrl.config import load_run_config
from relayrl.trainer.tracking import JsonlTracker
from tests.conftest import REPO

# -- Redis keys ------------------------------------------------------------------------------------------------
# Every way a key name could be spelled again outside redis_keys.py.
KEY_SPELLINGS = re.compile(
    r":rollout:|rollout:progress|rollout:done|:dropped_|dropped_key|:versions\b|:lineages\b"
    r'|-rank\{|"-rank"|b"group"|"relayrl:episodes:|"relayrl:weight_version:|:dead"|:invalid"'
)


def test_no_redis_key_is_spelled_outside_redis_keys() -> None:
    here = Path(__file__).resolve()
    sources = [
        p
        for folder in ("src", "tests", "scripts", "bench")
        for p in (REPO / folder).rglob("*.py")
        if "/pb/" not in p.as_posix()
    ]
    offenders = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in sources
        if p.resolve() != here and p.name != "redis_keys.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if KEY_SPELLINGS.search(line)
    ]

    assert offenders == []


def test_keys_derive_from_the_redis_config_section() -> None:
    cfg = load_run_config(None, ["redis.stream=exp:eps", "redis.group=g", "redis.version_key=exp:ver"])

    keys = RedisKeys.from_config(cfg.redis, cfg.name)

    assert (keys.stream, keys.group, keys.version_counter) == ("exp:eps", "g", "exp:ver")
    assert (keys.rollout_progress, keys.rollout_done) == ("exp:eps:rollout:progress", "exp:eps:rollout:done")
    assert (keys.dropped("stale"), keys.dropped("reward_error")) == (
        "exp:eps:dropped_stale",
        "exp:eps:dropped_reward_error",
    )
    assert (keys.versions, keys.lineages) == ("exp:ver:versions", "exp:ver:lineages")
    default = load_run_config(None, [])
    assert RedisKeys() == RedisKeys.from_config(default.redis, default.name)  # the defaults agree


def test_every_key_of_a_run_carries_its_name_and_deleting_it_keeps_the_version_counter() -> None:
    cfg = load_run_config(None, ["name=exp-2"])

    keys = RedisKeys.from_config(cfg.redis, cfg.name)

    assert (keys.stream, keys.version_counter) == ("relayrl:exp-2:episodes", "relayrl:exp-2:weight_version")
    assert all(":exp-2:" in key for key in keys.state()) and keys.version_counter not in keys.state()
    assert {keys.dead_letter, keys.invalid, keys.rollout_progress, keys.versions} <= set(keys.state())
    other = RedisKeys.from_config(cfg.redis, "exp-3")
    assert not set(keys.state()) & set(other.state())
    assert trainer_consumer("trainer", 3) == "trainer-rank3"


# -- the metrics row -------------------------------------------------------------------------------------------
def _rl(step: int, **overrides: Any) -> RlRow:
    values: dict[str, Any] = dict(
        step=step,
        weight_version=step + 1,
        reward_mean=0.1 * step,
        reward_std=0.2,
        reward_components={"exact": 0.5, "format": 1.0},
        episodes=8,
        tokens=40,
        staleness_mean=0.5,
        staleness_max=1,
        staleness_hist={"0": 4, "1": 4},
        episodes_dropped_stale=2,
        groups_dropped_stale=1,
        episodes_trained=8 * step,
        groups_trained=2 * step,
        loss=0.25,
        episodes_per_s=100.0 + step,
        step_time_s=0.3,
        time_s=0.5 * step,
        queue_lag=step % 3,
        queue_pending=4,
        weight_sync_s=0.01,
        weight_sync_bytes=1024,
        probe_max_diff=1e-6,
    )
    return RlRow(**(values | overrides))


def _write(path: Path, rows: list[RlRow | SftRow]) -> None:
    tracker = JsonlTracker(path)  # the trainer's writer
    for r in rows:
        tracker.log(r.to_json(), r.step if isinstance(r, RlRow) else r.sft_step)
    tracker.close()


def test_written_rows_read_back_equal_in_the_file_format(tmp_path: Path) -> None:
    rows: list[RlRow | SftRow] = [
        SftRow(sft_step=1, loss=2.0, grad_norm=1.5, time_s=0.1),
        _rl(1),
        _rl(2, queue_lag=None, weight_sync_s=None, weight_sync_bytes=None, probe_max_diff=None),
    ]
    path = tmp_path / "metrics.jsonl"
    _write(path, rows)

    lines = [json.loads(line) for line in path.read_text().splitlines()]

    assert read_rows(path) == rows
    assert lines[0] == {"phase": "sft", "sft_step": 1, "loss": 2.0, "grad_norm": 1.5, "time_s": 0.1}
    assert (
        "phase" not in lines[1] and lines[1]["reward/exact"] == 0.5 and lines[1]["staleness_hist"] == {"0": 4, "1": 4}
    )
    assert "weight_sync_s" not in lines[2] and lines[2]["queue_lag"] is None  # as the trainer always wrote them
    assert all(parse_row(line).to_json() == line for line in lines)  # type: ignore[union-attr]


def test_rows_of_older_versions_take_defaults_and_non_rows_are_skipped() -> None:
    old = parse_row({"step": 3, "reward_mean": 0.5, "staleness_max": 2.0, "queue_pending": None, "new_field": 1})

    assert isinstance(old, RlRow) and (old.step, old.reward_mean, old.staleness_max) == (3, 0.5, 2)
    assert (old.episodes_trained, old.queue_pending, old.queue_lag, old.reward_components) == (0, 0, None, {})
    assert {"episodes_trained", "queue_pending", "queue_lag"} <= old.missing and "reward_mean" not in old.missing
    assert [parse_line(x) for x in ('{"reward_mean": 1}', '{"phase": "eval", "step": 1}', "[1]", '{"ste')] == [None] * 4


def test_each_reader_consumes_rows_built_from_the_definition(tmp_path: Path) -> None:
    from relayrl.dashboard import read_metrics_chunk
    from relayrl.plot import plot_metrics, read_metrics
    from relayrl.run_report import progress_line, run_summary
    from relayrl.status import _training, render

    rows: list[RlRow | SftRow] = [
        SftRow(sft_step=10, loss=2.0),
        *(_rl(s) for s in range(1, 6)),
        _rl(6, reward_mean=math.nan),
    ]
    _write(tmp_path / "metrics.jsonl", rows)
    (tmp_path / "config.yaml").write_text("rollout:\n  max_staleness: 2\n")

    # the launcher's progress lines and summary
    assert progress_line(rows[0], 6) == "  warm-up   10  loss 2.000"
    assert progress_line(rows[1], 6) == ("  step    1/6  reward 0.100  staleness 0.50 (max 1)  episodes/s 101.0  0s")
    summary = run_summary(
        read_rows(tmp_path / "metrics.jsonl"), produced=14, stream_length=14, pending=2, durable_step=6
    )
    assert summary["groups_trained"] == 12 and summary["episodes_dropped_stale"] == 2
    # relayrl status
    training = _training(tmp_path, window=2)
    assert training["step"] == 6 and training["window_steps"] == 2 and training["staleness_max"] == 1
    assert "training   last 2 steps to step 6" in render({"services": {}, "training": training})
    # the dashboard: training steps only, the drawn fields, NaN as null
    chunk = read_metrics_chunk(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in chunk.rows] == [1, 2, 3, 4, 5, 6]
    assert chunk.rows[0]["reward_mean"] == 0.1 and chunk.rows[-1]["reward_mean"] is None
    assert chunk.rows[0]["queue_lag"] == 1 and "loss" not in chunk.rows[0]
    # relayrl plot
    assert read_metrics(tmp_path / "metrics.jsonl")[:5] == rows[1:6]  # (NaN is not equal to itself)
    plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "metrics.png")
    assert (tmp_path / "metrics.png").stat().st_size > 0


def test_multi_turn_figures_reach_status_and_dashboard(tmp_path: Path) -> None:
    from relayrl.dashboard import read_metrics_chunk
    from relayrl.status import _training, render

    rows: list[RlRow | SftRow] = [
        _rl(s, turns_mean=2.0, tool_calls_mean=1.0, tool_errors=s, episode_ends={"done": 6, "max_turns": 2})
        for s in (1, 2)
    ]
    _write(tmp_path / "metrics.jsonl", rows)

    training = _training(tmp_path, window=2)
    chunk = read_metrics_chunk(tmp_path / "metrics.jsonl")

    assert read_rows(tmp_path / "metrics.jsonl") == rows  # episode_ends round-trips like staleness_hist
    assert training["episode_ends"] == {"done": 12, "max_turns": 4} and training["tool_errors"] == 3
    assert (
        "multi-turn: 2.00 turns and 1.00 tool calls per episode, 3 tool errors; ended: done 12, max_turns 4"
        in render({"services": {}, "training": training})
    )
    assert chunk.rows[1]["turns_mean"] == 2.0 and chunk.rows[1]["tool_errors"] == 2


def test_readers_tolerate_a_row_of_an_older_version(tmp_path: Path) -> None:
    from relayrl.dashboard import read_metrics_chunk
    from relayrl.run_report import progress_line, run_summary
    from relayrl.status import _training

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5, "time_s": 2.0}) + "\n")
    row = read_rows(tmp_path / "metrics.jsonl")

    assert progress_line(row[0], 1) == "  step    1/1  reward 0.500  staleness 0.00 (max 0)  episodes/s 0.0  2s"
    assert run_summary(row, 1, 1, 0, durable_step=1)["groups_trained"] == 0
    assert _training(tmp_path)["reward_mean"] == 0.5
    assert read_metrics_chunk(tmp_path / "metrics.jsonl").rows == [{"step": 1, "time_s": 2.0, "reward_mean": 0.5}]


# -- retry policies --------------------------------------------------------------------------------------------
def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="test")


async def _calls(policy: RetryPolicy | None, codes: list[grpc.StatusCode]) -> tuple[int, str]:
    """Call a method failing with ``codes`` (then answering) through a client: (tries made, outcome)."""
    tries = []

    async def method(request: object, timeout: float, metadata: object) -> str:
        tries.append(timeout)
        if len(tries) <= len(codes):
            raise _error(codes[len(tries) - 1])
        return "ok"

    async def go() -> str:
        async with InferenceClient("127.0.0.1:1", timeout_s=7.0, retries=3, backoff_s=0.001) as client:
            try:
                return await client.call(method, None, policy=policy)
            except grpc.aio.AioRpcError as exc:
                return exc.code().name

    outcome = await go()
    assert all(t == 7.0 for t in tries)  # every try has the call's deadline
    return len(tries), outcome


async def test_only_the_policy_codes_are_retried_up_to_its_attempts() -> None:
    unavailable, deadline = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED
    fast = RetryPolicy(attempts=3, backoff_s=0.001)

    assert await _calls(None, [unavailable] * 3) == (4, "ok")  # the client's default: retries=3
    assert await _calls(fast, [unavailable] * 2) == (3, "ok")
    assert await _calls(fast, [unavailable] * 3) == (3, "UNAVAILABLE")
    assert await _calls(fast, [deadline]) == (1, "DEADLINE_EXCEEDED")
    assert await _calls(NO_RETRY, [unavailable]) == (1, "UNAVAILABLE")
    assert [RetryPolicy(backoff_s=0.5, max_backoff_s=1.5).delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 1.5, 1.5]
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


async def test_policies_are_chosen_per_method() -> None:
    async def go() -> tuple[RetryPolicy, RetryPolicy]:
        async with InferenceClient("127.0.0.1:1", policies={"Generate": NO_RETRY}) as client:
            return client.policy_for("Generate"), client.policy_for("GetStatus")

    generate, status = await go()

    assert generate is NO_RETRY and status.attempts == 4


def test_rollout_calls_generate_and_score_through_the_typed_clients() -> None:
    rollout = REPO / "src" / "relayrl" / "rollout"
    source = "".join(p.read_text() for p in [rollout / "producer.py", *sorted((rollout / "workflows").glob("*.py"))])

    assert "Stub(" not in source and "_pb2_grpc" not in source
    assert ".generate(" in source and ".score_batch(" in source and ".trainer.status()" in source


def test_summary_counts_groups_handled_after_the_last_checkpoint_once_as_pending() -> None:
    from relayrl.run_report import run_summary

    # 6 steps of 2 groups (+1 stale drop per step); the checkpoint holds step 4; the run stopped after step 6.
    rows: list[MetricsRow] = [_rl(s, groups_dropped_stale=s) for s in range(1, 7)]
    produced, unacked = 20, 20 - (8 + 4)  # acknowledged: what checkpoint 4 holds

    summary = run_summary(rows, produced=produced, stream_length=produced, pending=unacked, durable_step=4)

    assert (summary["groups_trained"], summary["groups_dropped_stale"], summary["checkpoint_step"]) == (8, 4, 4)
    assert summary["groups_after_checkpoint"] == (12 + 6) - (8 + 4)
    assert (
        summary["groups_produced"]
        == summary["groups_trained"]
        + summary["groups_dropped_stale"]
        + summary["groups_dropped_reward_error"]
        + summary["groups_pending"]
    )


def test_summary_counts_dead_lettered_entries_as_invalid_apart_from_the_checkpoint() -> None:
    from relayrl.run_report import run_summary

    # 4 steps of 2 groups; the checkpoint holds step 4; 3 entries (7 episodes) were dead-lettered (acknowledged when
    # moved, so never pending), 1 of them appended by something other than rollout; 2 groups are pending;
    # acknowledged entries were trimmed from the stream.
    rows: list[MetricsRow] = [_rl(s, groups_dropped_stale=1) for s in range(1, 5)]

    summary = run_summary(
        rows, produced=8 + 1 + 2 + 2, stream_length=2, pending=2, durable_step=4, invalid=(3, 7), foreign=1
    )

    assert (summary["groups_invalid"], summary["episodes_invalid"], summary["groups_foreign"]) == (3, 7, 1)
    assert (
        summary["groups_produced"] + summary["groups_foreign"]
        == summary["groups_trained"]
        + summary["groups_dropped_stale"]
        + summary["groups_dropped_reward_error"]
        + summary["groups_invalid"]
        + summary["groups_pending"]
    )
    assert summary["groups_after_checkpoint"] == 0


def test_ports_picked_together_are_distinct() -> None:
    from relayrl.local_redis import free_ports

    ports = free_ports(64)

    assert len(set(ports)) == 64
