"""bench/scale_sim.py end to end on a short window: the real rollout service against 1 and 2 simulated inference
replicas (bench/scale_sim_replicas.py), a real redis-server and reward service, the simulated trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_scale_sim_with_one_and_two_replicas_prints_the_table_and_two_replicas_append_more_episodes(
    tmp_path: Path,
) -> None:
    out = tmp_path / "scale.jsonl"
    # short samples and a fast engine: a replica's joined batch lasts about a second, several per window
    cmd = [sys.executable, str(REPO / "bench" / "scale_sim.py"), "--replicas=1,2", "--seconds=3", "--warmup=1"]
    cmd += ["--max-new-tokens=16", "--tokens-per-s=1000", "--groups-per-replica=8", "--no-profile", f"--json={out}"]

    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)

    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "| N | episodes/s | ratio to N x 1-replica | rollout CPU % |" in proc.stdout
    assert "saturation:" in proc.stdout
    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    one, two = result["points"]
    assert (one["replicas"], two["replicas"]) == (1, 2)
    assert one["episodes_per_s"] > 0
    assert two["episodes_per_s"] > one["episodes_per_s"]
    assert one["ratio"] == 1.0
    assert set(one["cpu_pct"]) == {"rollout", "simulator", "redis", "harness"}
    assert one["rollout_state"]["groups_failed"] == 0 and two["rollout_state"]["groups_failed"] == 0
    assert result["latency_model"]["step_ms"] == pytest.approx(64.0)
    assert result["profile"] is None
