"""However `relayrl run` ends short of a power cut, no process of its stack survives it, and its summary adds up:
SIGTERM, SIGHUP and SIGINT stop the stack in order; after a SIGKILL of the launcher its children get SIGTERM from
the kernel (parent-death signal) and stop by themselves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO
from tests.polling import wait_for

pytestmark = [pytest.mark.security, pytest.mark.integration, pytest.mark.slow(seconds=60)]


def _start(out: Path, model: Path, *settings: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "run",
            "examples/quickstart.yaml",
            "--out",
            str(out),
            "--set",
            f"model.path={model}",
            "--set",
            "trainer.total_steps=100000",
            "--set",
            "trainer.checkpoint_every=3",
            "--set",
            "rollout.max_new_tokens=2",
            *(arg for kv in settings for arg in ("--set", kv)),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _until_training(out: Path, proc: subprocess.Popen[str], steps: int = 4, timeout_s: float = 240) -> None:
    metrics = out / "metrics.jsonl"
    wait_for(
        lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= steps,
        f"{steps} training steps",
        timeout_s,
        alive=proc,
    )


def _stack(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    stack = psutil.Process(proc.pid).children(recursive=True)
    names = " ".join(" ".join(p.cmdline()) for p in stack)
    assert "redis-server" in names and all(f"serve {s}" in names for s in ("inference", "reward", "rollout", "trainer"))
    return stack


def _survivors(stack: list[psutil.Process], timeout_s: float) -> list[str]:
    """The processes of ``stack`` still running after ``timeout_s`` (zombies count as gone)."""
    _, alive = psutil.wait_procs(stack, timeout=timeout_s)
    return [f"{p.pid} {' '.join(p.cmdline())}" for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_stop_signal_to_the_launcher_stops_every_process_and_the_summary_adds_up(
    tmp_path: Path, demo_model: Path, sig: signal.Signals
) -> None:
    out = tmp_path / "run"
    proc = _start(out, demo_model)
    try:
        _until_training(out, proc)
        stack = _stack(proc)

        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()

    assert proc.returncode == (130 if sig is signal.SIGINT else 128 + sig), output[-2000:]
    assert _survivors(stack, timeout_s=5) == []
    _assert_books_add_up(out, output)


def _assert_books_add_up(out: Path, output: str) -> None:
    """summary.json and the printed summary hold the accounting identity, each group counted once."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups_produced"] == (
        summary["groups_trained"]
        + summary["groups_dropped_stale"]
        + summary["groups_dropped_reward_error"]
        + summary["groups_invalid"]
        + summary["groups_pending"]
    )
    assert "groups produced" in output


def test_a_dead_service_stops_the_whole_stack_with_exit_1_and_the_summary_adds_up(
    tmp_path: Path, demo_model: Path
) -> None:
    out = tmp_path / "run"
    proc = _start(out, demo_model)
    try:
        _until_training(out, proc)
        stack = _stack(proc)
        rollout = next(p for p in stack if "serve rollout" in " ".join(p.cmdline()))

        rollout.kill()
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()

    assert proc.returncode == 1, output[-2000:]
    assert "service rollout died" in output
    assert _survivors(stack, timeout_s=5) == []
    _assert_books_add_up(out, output)


def test_services_stop_by_themselves_when_the_launcher_is_killed(tmp_path: Path, demo_model: Path) -> None:
    out = tmp_path / "run"
    # Redis dies with the launcher: a group append in flight at that moment is retried for redis.retry_s (60 s by
    # default) before rollout gives up and stops, which a CI run once caught past the 30 s below; 5 s bounds it.
    # The trainer's graceful stop settles a weight push in flight, retried against the dead inference for up to
    # trainer.publication.push_timeout_s (60 s): nobody is left to kill it, so it gives its graceful stop up after
    # its stop deadline (trainer.stop_grace_s here; the old code stayed up past the 30 s below)
    proc = _start(out, demo_model, "redis.retry_s=5", "trainer.stop_grace_s=5")
    try:
        _until_training(out, proc, steps=1)
        stack = _stack(proc)

        proc.kill()
        proc.wait(timeout=10)
        survivors = _survivors(stack, timeout_s=30)  # each stops gracefully on its parent-death SIGTERM
    finally:
        for p in psutil.Process().children(recursive=True):
            if p.pid != proc.pid and "relayrl" in " ".join(p.cmdline()):
                p.kill()

    assert survivors == []


def test_run_credentials_reach_the_services_only_through_their_environment(tmp_path: Path, demo_model: Path) -> None:
    out = tmp_path / "run"
    proc = _start(out, demo_model)
    try:
        _until_training(out, proc, steps=1)
        token = (out / "control_token").read_text().strip()
        redis_password = (out / "redis_password").read_text().strip()
        stack = _stack(proc)
        argv = [" ".join(p.cmdline()) for p in stack]
        environments = [p.environ() for p in stack if "serve rollout" in " ".join(p.cmdline())]

        paused = subprocess.run(
            [sys.executable, "-m", "relayrl.cli", "control", "pause", str(out)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if "RELAYRL_" not in k},
        )
        status = subprocess.run(
            [sys.executable, "-m", "relayrl.cli", "status", "--json", str(out)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if "RELAYRL_" not in k},
        )
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()

    assert paused.returncode == 0, paused.stdout + paused.stderr  # with the run folder's token
    assert all(token not in a for a in argv)
    assert environments and environments[0]["RELAYRL_CONTROL_TOKEN"] == token
    assert token not in (out / "config.yaml").read_text()
    assert all(token not in p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))
    # the embedded Redis's password: in the services' environment only (and the owner-only file for status)
    assert len(redis_password) >= 32 and all(redis_password not in a for a in argv)
    assert environments[0]["RELAYRL_REDIS_PASSWORD"] == redis_password
    assert redis_password not in (out / "config.yaml").read_text()
    assert all(redis_password not in p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))
    assert "length" in json.loads(status.stdout)["queue"], status.stdout + status.stderr
