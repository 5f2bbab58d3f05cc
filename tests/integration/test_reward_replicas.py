"""Reward replicas behind one target: rollout's reward client spreads its calls round robin over every address the
target names (``ipv4:a,b`` here; a headless Service's pods in the chart), so each replica scores its share of a
run; one replica SIGKILLed mid-run leaves the rotation, its calls in flight are retried on the other, and no group
is lost or fails its scoring."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.client import RewardClient
from relayrl.common.grpc_utils import check_health
from relayrl.config import dump_run_config, load_run_config
from relayrl.status import Target, collect, exit_code, render
from tests.conftest import REPO, RedisServer, free_port
from tests.integration.helpers import reward_server
from tests.integration.stack import run_stack, stack_config

pytestmark = pytest.mark.integration

REWARD = "relayrl.tasks.arithmetic:reward"


def _books_add_up(out: dict[str, object], groups: int) -> None:
    assert out["trained"] == groups  # every step's groups trained: none lost, none dropped for a reward error
    assert out["produced"] == out["trained"] + out["dropped"] + out["invalid"] + out["pending"]  # type: ignore[operator]
    assert out["dropped_reward_error"] == out["episodes_reward_errors"] == 0


async def test_two_reward_replicas_behind_one_target_each_score_a_fair_share_of_a_run(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    steps = 6
    cfg = stack_config(tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url, f"trainer.total_steps={steps}")
    async with reward_server(REWARD) as (a, replica_a), reward_server(REWARD) as (b, replica_b):
        out = await run_stack(cfg, tiny_model_dir, reward_target=f"ipv4:{a},{b}")

    _books_add_up(out, steps * 2)
    shares = [replica_a.scored, replica_b.scored]
    # a fair share: each within 30 % of half the run's scored episodes (one replica alone would score all of them)
    assert all(abs(n - sum(shares) / 2) <= 0.3 * sum(shares) / 2 for n in shares), shares
    assert sum(shares) >= out["produced"] * 4  # type: ignore[operator]  # (4 episodes a group)


@contextlib.contextmanager
def reward_process(tmp: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """A reward replica as its own process (`relayrl serve reward`, as compose and the chart start it) on ``port``,
    SERVING when yielded."""
    cfg = load_run_config(
        None,
        [f"reward.server.port={port}", "reward.http.enabled=false", "reward.workers=1", f"reward.function={REWARD}"],
    )
    path = tmp / "reward.yaml"
    dump_run_config(cfg, path)
    cmd = [sys.executable, "-m", "relayrl.cli", "serve", "reward", str(path)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not check_health(f"127.0.0.1:{port}", 1.0):
            assert proc.poll() is None, f"the reward replica exited with {proc.returncode}"
        yield proc
    finally:
        proc.kill()
        proc.wait()


async def test_a_reward_replica_killed_mid_run_leaves_the_rotation_and_the_other_scores_the_rest(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    steps = 10
    cfg = stack_config(tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url, f"trainer.total_steps={steps}")
    port = free_port()
    with reward_process(tmp_path, port) as doomed:
        async with reward_server(REWARD) as (survivor_target, survivor):
            scored_before_kill: list[int] = []

            async def kill_once_it_scored() -> None:
                async with RewardClient(f"127.0.0.1:{port}") as client:
                    while (await client.status()).scored < 8:  # two groups: mid-run, most of the run still ahead
                        await asyncio.sleep(0.02)
                scored_before_kill.append(survivor.scored)
                doomed.send_signal(signal.SIGKILL)

            killer = asyncio.create_task(kill_once_it_scored())
            out = await run_stack(cfg, tiny_model_dir, reward_target=f"ipv4:127.0.0.1:{port},{survivor_target}")
            await killer

    assert doomed.wait() == -signal.SIGKILL and scored_before_kill  # the kill landed during the run
    _books_add_up(out, steps * 2)
    assert [r["step"] for r in out["rows"]] == list(range(1, steps + 1))
    assert survivor.scored > scored_before_kill[0]  # scoring went on on the other replica


async def test_status_shows_each_reward_replica_behind_the_target_and_the_one_that_is_down(
    redis_server: RedisServer,
) -> None:
    async with contextlib.AsyncExitStack() as first, contextlib.AsyncExitStack() as second:
        a, _ = await first.enter_async_context(reward_server(REWARD))
        b, _ = await second.enter_async_context(reward_server(REWARD))
        cfg = load_run_config(None, [f"reward.server.address=ipv4:{a},{b}", f"redis.url={redis_server.url}"])
        up = await collect(Target(cfg, None, None), timeout_s=3)
        await second.aclose()  # replica b stops
        down = await collect(Target(cfg, None, None), timeout_s=3)

    assert [r["address"] for r in up["replicas"]["reward"]] == [a, b]
    assert all(r["component"]["state"] == "SERVING_STATE_SERVING" for r in up["replicas"]["reward"])
    replica_lines = [line.split() for line in render(up).splitlines() if line.startswith("  replica")]
    assert [(words[1], words[2]) for words in replica_lines] == [(a, "SERVING"), (b, "SERVING")]
    first_replica, second_replica = down["replicas"]["reward"]
    assert "error" not in first_replica and second_replica["error"].startswith("UNAVAILABLE")
    assert "error" not in down["services"]["reward"]  # the balanced client still reaches the other
    assert [line.split()[1:3] for line in render(down).splitlines() if line.startswith("  replica")] == [
        [a, "SERVING"],
        [b, "DOWN"],
    ]
    # the exit status counts a replica that is down (the other services are not running in this test)
    reward_only = [{"services": {"reward": st["services"]["reward"]}, "replicas": st["replicas"]} for st in (up, down)]
    assert [exit_code(st) for st in reward_only] == [0, 1]
