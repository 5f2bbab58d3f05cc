"""End to end: `relayrl run --set inference.replicas=3`, the quickstart with three local inference processes on
ports of their own: it learns as with one, a replica killed mid-run is started again, caught up and routed to
again, each replica serves the last verified version, no token trains beyond the staleness bound, and the books
add up."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import pytest
import yaml

from relayrl.common.pb import inference_pb2, inference_pb2_grpc
from tests.conftest import REPO
from tests.polling import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STEPS = 300  # as tests/e2e/test_quickstart.py: one replica's 10-step mean passes 0.8 at about step 190


def _rl_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(json.loads(line).get("phase", "rl") == "rl" for line in lines)


def _replica_pid(out: Path, port: str) -> int:
    """The pid of the inference replica `relayrl run` started for ``out`` on gRPC port ``port``."""
    config = str(out / "config.yaml")
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if config in cmdline and f"inference.server.port={port}" in cmdline:
            return int(proc.pid)
    raise AssertionError(f"no inference replica on port {port}")


def _status(address: str) -> inference_pb2.InferenceStatus | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return inference_pb2_grpc.InferenceServiceStub(channel).GetStatus(
                inference_pb2.GetInferenceStatusRequest(), timeout=2.0
            )
        except grpc.RpcError:
            return None


def test_quickstart_with_three_inference_replicas_learns_and_a_killed_replica_restarts_catches_up_and_serves(
    tmp_path: Path, demo_model: Path
) -> None:
    out = tmp_path / "run"
    overrides = [f"model.path={demo_model}", f"trainer.total_steps={STEPS}", "inference.replicas=3"]
    stdout = tmp_path / "stdout.txt"
    with stdout.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relayrl.cli", "run", "examples/quickstart.yaml", "--out", str(out)]
            + [arg for o in overrides for arg in ("--set", o)],
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        wait_for(lambda: _rl_steps(out) >= 40, "40 steps trained", alive=proc)
        second = yaml.safe_load((out / "config.yaml").read_text())["inference"]["endpoints"][1]["address"]
        os.kill(_replica_pid(out, second.rpartition(":")[2]), signal.SIGKILL)
        killed_at = _rl_steps(out)
        wait_for(lambda: "inference-2 died" in stdout.read_text(), "the launcher restarts inference-2", alive=proc)

        # started again, it gets the current weights from the trainer, then rollout routes to it again
        def serving_again() -> bool:
            status = _status(second)
            return status is not None and status.weight_version > 0 and status.requests_served > 0

        wait_for(serving_again, "the restarted inference-2 caught up and generating", alive=proc)
        assert _rl_steps(out) < STEPS, "the run ended before the restarted replica served: kill earlier"
        assert proc.wait(timeout=900) == 0, stdout.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)

    text = stdout.read_text()
    healthy = next(line for line in text.splitlines() if "all services healthy" in line)
    assert "inference-2=127.0.0.1:" in healthy and "inference-3=127.0.0.1:" in healthy
    assert "restarted inference-2 1x" in text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase", "rl") == "rl"]
    assert [r["step"] for r in rl] == list(range(1, STEPS + 1))
    last = statistics.mean(r["reward_mean"] for r in rl[-10:])
    assert last >= 0.8, f"final reward {last:.3f}"
    # the quickstart's max_staleness, over the whole pool, before and after the kill
    assert max(r["staleness_max"] for r in rl) <= 1, killed_at
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == {"inference-2": 1}
    drops = sum(v for k, v in summary.items() if k.startswith("groups_dropped_"))
    assert summary["groups_produced"] == (
        summary["groups_trained"] + drops + summary["groups_invalid"] + summary["groups_pending"]
    )
    assert summary["groups_trained"] == STEPS * 8
    # every replica swapped to the last version the trainer published (inference-2 after its restart too)
    final = rl[-1]["weight_version"]
    for name in ("inference", "inference-2", "inference-3"):
        log = (out / "logs" / f"{name}.log").read_text()
        swapped = [int(v) for v in re.findall(r"weights swapped to version (\d+)", log)]
        assert swapped and swapped[-1] == final, (name, swapped[-3:], final)
