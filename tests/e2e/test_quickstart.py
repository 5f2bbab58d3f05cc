"""End to end: the real `relayrl run` of the quickstart, as a user runs it."""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow(seconds=65), pytest.mark.integration]

SERVICES = ("inference", "reward", "rollout", "trainer")
QUICKSTART_STEPS = 300


def _relayrl(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_quickstart_learns_and_honours_the_metrics_contract(tmp_path: Path, demo_model: Path) -> None:
    out = tmp_path / "run"

    # 300 of the example's 800 steps: its 10-step mean passes 0.8 at about step 170-190 and 0.9 at steps 230-320
    # (docs/quickstart.md), so the final reward of a working stack is above the bar below, and CI saves minutes
    proc = _relayrl(
        "run",
        "examples/quickstart.yaml",
        "--set",
        f"model.path={demo_model}",
        "--out",
        str(out),
        "--set",
        f"trainer.total_steps={QUICKSTART_STEPS}",
        timeout=900,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all services healthy" in proc.stdout and "step" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase", "rl") == "rl"]
    assert [r["step"] for r in rl] == list(range(1, QUICKSTART_STEPS + 1))
    assert all(b["weight_version"] > a["weight_version"] for a, b in itertools.pairwise(rl))
    required = {
        "step",
        "weight_version",
        "reward_mean",
        "episodes",
        "tokens",
        "staleness_mean",
        "staleness_max",
        "time_s",
    }
    assert all(required <= set(r) for r in rl)
    assert max(r["staleness_max"] for r in rl) <= 1  # the quickstart's max_staleness
    first = statistics.mean(r["reward_mean"] for r in rl[:10])
    last = statistics.mean(r["reward_mean"] for r in rl[-10:])
    assert last >= 0.8, f"final reward {last:.3f} (first {first:.3f})"
    assert last - first >= 0.4, f"reward rose only from {first:.3f} to {last:.3f}"
    assert rl[-1]["time_s"] < 600
    assert (out / "config.yaml").is_file()
    for name in SERVICES:
        lines = (out / "logs" / f"{name}.log").read_text().splitlines()
        tagged = [line for line in lines if f"[{name} rank=0]" in line]
        assert tagged, f"no tagged lines in {name}.log"
    checkpoints = sorted((out / "checkpoints").glob("step_*"))
    assert checkpoints and (checkpoints[-1] / "model" / "model.safetensors").is_file()

    plot = _relayrl("plot", str(out), timeout=120)

    assert plot.returncode == 0, plot.stderr
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_service_that_dies_stops_the_run_with_its_name(tmp_path: Path, demo_model: Path) -> None:
    proc = _relayrl(
        "run",
        "examples/quickstart.yaml",
        "--set",
        f"model.path={demo_model}",
        "--set",
        "reward.function=relayrl.tasks.no_such_module:reward",
        "--out",
        str(tmp_path / "run"),
        timeout=300,
    )

    assert proc.returncode == 1
    assert "service reward died" in proc.stdout
    assert "no_such_module" in proc.stdout  # the tail of its log says why


def test_ctrl_c_stops_every_service(tmp_path: Path, demo_model: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "run",
            "examples/quickstart.yaml",
            "--set",
            f"model.path={demo_model}",
            "--set",
            "trainer.total_steps=100000",
            "--out",
            str(out),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        if ("step" in line and "/100000" in line) or time.monotonic() > deadline:
            break

    proc.send_signal(signal.SIGINT)
    code = proc.wait(60)

    assert code == 130
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert [pid for pid in leftovers if int(pid) != os.getpid()] == []


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_staleness_bound_versions_and_accounting_hold_end_to_end(
    tmp_path: Path, demo_model: Path, max_staleness: int
) -> None:
    out = tmp_path / "run"

    proc = _relayrl(
        "run",
        "examples/quickstart.yaml",
        "--set",
        f"model.path={demo_model}",
        "--set",
        f"rollout.max_staleness={max_staleness}",
        "--set",
        "trainer.total_steps=30",
        "--set",
        "trainer.dump_episodes=128",  # every trained episode, with its token versions
        "--out",
        str(out),
        timeout=600,
    )

    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30
    assert all(r["staleness_max"] <= max_staleness for r in rows)
    # the bound checked from the outside too, from every trained episode's token versions: each version is the
    # policy step of the newest step whose published version is not above it (allocations only go up; a re-push
    # shares its step's policy), and step k trains with the weights of policy step k - 1
    published = [(r["weight_version"], r["step"]) for r in rows]
    trained = [json.loads(line) for line in (out / "trained" / "episodes" / "rank0.jsonl").read_text().splitlines()]
    lags = [
        ep["step"] - 1 - max((s for v, s in published if v <= min(map(int, ep["token_weight_versions"]))), default=0)
        for ep in trained
    ]
    assert len(trained) == 30 * 8 * 16 and max(lags) <= max_staleness and min(lags) >= 0
    assert all(b["weight_version"] > a["weight_version"] for a, b in itertools.pairwise(rows))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups_pending"] <= summary["stream_length"] < summary["groups_produced"]  # acked ones trimmed
    assert summary["groups_produced"] == (
        summary["groups_trained"]
        + summary["groups_dropped_stale"]
        + summary["groups_invalid"]
        + summary["groups_pending"]
    )
    assert summary["groups_trained"] == 30 * 8
    assert summary["episodes_trained"] == 30 * 8 * 16
    assert "groups produced" in proc.stdout
    # the shares of the trainer's wall time over the run, printed and in summary.json (shares of one whole)
    shares = summary["trainer_time"]
    parts = ("data_wait", "compute", "publication", "checkpoint_ack", "metrics", "other")
    assert sum(shares[p] for p in parts) == pytest.approx(1.0, rel=0, abs=1e-9) and 0 < shares["compute"] < 1
    # plumbing: all but compute and the wait for generation (a part of the data wait)
    assert 0 <= shares["generation"] <= shares["data_wait"] + 1e-12
    assert shares["plumbing"] == pytest.approx(1 - shares["compute"] - shares["generation"], rel=0, abs=1e-12)
    assert "trainer time over" in proc.stdout and "plumbing" in proc.stdout
