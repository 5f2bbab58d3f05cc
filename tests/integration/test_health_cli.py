"""`relayrl health`: one grpc.health.v1 Check with a deadline, exit 0 when SERVING, 1 otherwise."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from relayrl.tasks.arithmetic import reward as arithmetic_reward
from tests.conftest import REPO, free_port
from tests.integration.helpers import reward_server

pytestmark = pytest.mark.integration


async def _health_cli(*args: str) -> tuple[int, str, float]:
    """Run `python -m relayrl.cli health ...` in a subprocess without blocking the in-process server's loop."""
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "relayrl.cli",
        "health",
        *args,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), time.monotonic() - start


async def test_health_of_serving_server_exits_zero_and_prints_serving() -> None:
    async def go() -> None:
        async with reward_server(arithmetic_reward) as (target, _):
            code, out, _ = await _health_cli("--target", target, "--timeout", "5")

            assert code == 0, out
            assert out.strip() == f"{target}: SERVING"

    await go()


async def test_health_of_named_registered_service_exits_zero() -> None:
    async def go() -> None:
        async with reward_server(arithmetic_reward) as (target, _):
            code, out, _ = await _health_cli("--target", target, "--service", "relayrl.v1.RewardService")

            assert code == 0, out

    await go()


async def test_health_of_unknown_service_name_exits_one() -> None:
    async def go() -> None:
        async with reward_server(arithmetic_reward) as (target, _):
            code, out, _ = await _health_cli("--target", target, "--service", "no.such.Service", "--timeout", "5")

            assert code == 1, out
            assert "NOT_FOUND" in out

    await go()


def test_health_of_port_without_listener_exits_one_within_timeout() -> None:
    target = f"127.0.0.1:{free_port()}"
    timeout_s = 2.0

    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "health", "--target", target, "--timeout", str(timeout_s)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    elapsed, code, out = time.monotonic() - start, result.returncode, result.stdout + result.stderr

    assert code == 1, out
    assert len(out.strip().splitlines()) == 1
    assert out.startswith(f"{target}: ")
    # the deadline bounds the call; allow for the interpreter's start-up on a slow machine
    assert elapsed < timeout_s + 10, elapsed
