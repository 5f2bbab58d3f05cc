"""End to end: `relayrl run --set inference.replicas=3`, the quickstart with three local inference processes on
ports of their own: it learns as with one while each replica in turn is killed with SIGKILL, started again, caught
up and routed to again; each replica serves the last verified version, no token trains beyond the staleness bound,
and the books add up."""

from __future__ import annotations

import functools
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

pytestmark = [pytest.mark.slow(seconds=55), pytest.mark.integration]

STEPS = 300  # as tests/e2e/test_quickstart.py: one replica's 10-step mean passes 0.8 at about step 190


def _rl_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(json.loads(line).get("phase", "rl") == "rl" for line in lines)


def _replica_pid(out: Path, name: str) -> int:
    """The pid of the inference replica ``name`` (``inference``, ``inference-2``, ...) `relayrl run` started for
    ``out``: the first has the config's ports, the others theirs by ``--set``."""
    config = str(out / "config.yaml")
    endpoints = yaml.safe_load((out / "config.yaml").read_text())["inference"]["endpoints"]
    index = int(name.partition("-")[2] or 1) - 1
    port = endpoints[index]["address"].rpartition(":")[2]
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if config not in cmdline or cmdline[cmdline.index(config) - 1] != "inference":
            continue
        if f"inference.server.port={port}" in cmdline or (index == 0 and "--set" not in cmdline):
            return int(proc.pid)
    raise AssertionError(f"no inference replica {name}")


def _status(address: str) -> inference_pb2.InferenceStatus | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return inference_pb2_grpc.InferenceServiceStub(channel).GetStatus(
                inference_pb2.GetInferenceStatusRequest(), timeout=2.0
            )
        except grpc.RpcError:
            return None


def _serving_again(address: str) -> bool:
    """The replica at ``address`` serves trained weights (version > 0) and has generated since it started."""
    status = _status(address)
    return status is not None and status.weight_version > 0 and status.requests_served > 0


def _caught_up_replica(address: str) -> bool:
    """The replica at ``address`` answers and serves trained weights (version > 0): the trainer caught it up."""
    status = _status(address)
    return status is not None and status.weight_version > 0


def _caught_up(out: Path) -> bool:
    """Every replica serves the weights of the last step trained so far (generation is paused: the trainer stops
    within a few steps, and its watchdog catches each restarted replica up, under a fresh version of the same
    weights: at least the last step's)."""
    try:
        latest = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["weight_version"]
    except json.JSONDecodeError:  # the row being written: asked again
        return False
    endpoints = yaml.safe_load((out / "config.yaml").read_text())["inference"]["endpoints"]
    return all((s := _status(e["address"])) is not None and s.weight_version >= latest for e in endpoints)


def _control(out: Path, action: str) -> None:
    """`relayrl control ACTION RUN_DIR` (the run's own control token)."""
    done = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "control", action, str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


# (steps after the previous kill's recovery, replica): each in turn. Relative, so that a slow restart (a loaded
# machine: 25 s seen in CI, 150 steps of this run) still leaves every kill inside the run.
KILLS = ((40, "inference-2"), (10, "inference-3"), (10, "inference"))


def test_quickstart_with_three_inference_replicas_learns_while_each_is_killed_in_turn_restarted_and_caught_up(
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
        for gap, name in KILLS:
            step = _rl_steps(out) + gap
            wait_for(lambda step=step: _rl_steps(out) >= step, f"{step} steps trained", alive=proc)
            os.kill(_replica_pid(out, name), signal.SIGKILL)
            wait_for(lambda name=name: f"{name} died" in stdout.read_text(), f"{name} restarted", alive=proc)
            if name == "inference-2":  # started again, the trainer catches it up, then rollout routes to it again
                second = yaml.safe_load((out / "config.yaml").read_text())["inference"]["endpoints"][1]["address"]
                # generation held while it restarts: a slow restart on a loaded machine outlasted the whole run in
                # one CI run (the other two replicas generate on meanwhile, until the hold)
                _control(out, "pause")
                wait_for(functools.partial(_caught_up_replica, second), "inference-2 caught up", alive=proc)
                _control(out, "resume")
                wait_for(functools.partial(_serving_again, second), "inference-2 generating again", alive=proc)
        assert _rl_steps(out) < STEPS, "the run ended before the last kill took effect: kill earlier"
        # the run must not end before the last replicas restarted are caught up, however long their restart takes
        # on a loaded machine: generation pauses (the trainer waits for groups) until every replica serves the last
        # version, then goes on
        _control(out, "pause")
        wait_for(lambda: _caught_up(out), "every replica caught up", alive=proc)
        _control(out, "resume")
        assert proc.wait(timeout=900) == 0, stdout.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)

    text = stdout.read_text()
    healthy = next(line for line in text.splitlines() if "all services healthy" in line)
    assert "inference-2=127.0.0.1:" in healthy and "inference-3=127.0.0.1:" in healthy
    assert "restarted inference 1x, inference-2 1x, inference-3 1x" in text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase", "rl") == "rl"]
    assert [r["step"] for r in rl] == list(range(1, STEPS + 1))
    last = statistics.mean(r["reward_mean"] for r in rl[-10:])
    assert last >= 0.8, f"final reward {last:.3f}"
    assert max(r["staleness_max"] for r in rl) <= 1  # the quickstart's max_staleness, over the pool, kills included
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == {"inference": 1, "inference-2": 1, "inference-3": 1}
    drops = sum(v for k, v in summary.items() if k.startswith("groups_dropped_"))
    assert summary["groups_produced"] == (
        summary["groups_trained"] + drops + summary["groups_invalid"] + summary["groups_pending"]
    )
    assert summary["groups_trained"] == STEPS * 8
    # every replica swapped to the last version the trainer published, after its restart
    final = rl[-1]["weight_version"]
    for name in ("inference", "inference-2", "inference-3"):
        log = (out / "logs" / f"{name}.log").read_text()
        swapped = [int(v) for v in re.findall(r"weights swapped to version (\d+)", log)]
        assert swapped and swapped[-1] == final, (name, swapped[-3:], final)
