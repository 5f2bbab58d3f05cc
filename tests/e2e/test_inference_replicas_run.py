"""End to end: `relayrl run --set inference.replicas=3`, the quickstart with three local inference processes on
ports of their own: it learns as with one, each replica serves every verified version, and the books add up."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STEPS = 300  # as tests/e2e/test_quickstart.py: one replica's 10-step mean passes 0.8 at about step 190


def test_quickstart_with_three_inference_replicas_learns_and_every_replica_serves_the_last_version(
    tmp_path: Path, demo_model: Path
) -> None:
    out = tmp_path / "run"
    overrides = [f"model.path={demo_model}", f"trainer.total_steps={STEPS}", "inference.replicas=3"]
    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "run", "examples/quickstart.yaml", "--out", str(out)]
        + [arg for o in overrides for arg in ("--set", o)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    healthy = next(line for line in proc.stdout.splitlines() if "all services healthy" in line)
    assert "inference-2=127.0.0.1:" in healthy and "inference-3=127.0.0.1:" in healthy
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase", "rl") == "rl"]
    assert [r["step"] for r in rl] == list(range(1, STEPS + 1))
    last = statistics.mean(r["reward_mean"] for r in rl[-10:])
    assert last >= 0.8, f"final reward {last:.3f}"
    assert max(r["staleness_max"] for r in rl) <= 1  # the quickstart's max_staleness, over the whole pool
    summary = json.loads((out / "summary.json").read_text())
    drops = sum(v for k, v in summary.items() if k.startswith("groups_dropped_"))
    assert summary["groups_produced"] == (
        summary["groups_trained"] + drops + summary["groups_invalid"] + summary["groups_pending"]
    )
    assert summary["groups_trained"] == STEPS * 8
    # every replica swapped to each version the trainer published (the last one included) and served requests
    final = rl[-1]["weight_version"]
    for name in ("inference", "inference-2", "inference-3"):
        log = (out / "logs" / f"{name}.log").read_text()
        swapped = [int(v) for v in re.findall(r"weights swapped to version (\d+)", log)]
        assert swapped and swapped[-1] == final, (name, swapped[-3:], final)
