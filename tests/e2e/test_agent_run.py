"""End to end: a run whose rollout workflow is a black-box agent (rollout.workflow: agent). The agent, written
against the official `openai` client (tests/integration/test_agent_sessions.py), talks to rollout's session endpoint
for three turns per session; the trainer trains on the sessions' episodes: every group valid, none errored, and
every episode one token sequence of several model turns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STEPS = 3


def test_run_with_the_agent_workflow_trains_on_multi_turn_session_episodes(
    tmp_path: Path, chat_model_dir: Path
) -> None:
    out = tmp_path / "run"
    overrides = {
        "model.path": chat_model_dir,
        "rollout.workflow": "agent",
        "rollout.agent.function": "tests.integration.test_agent_sessions:multi_turn_agent",
        "rollout.temperature": 0.9,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 8,
        "rollout.max_episode_tokens": 128,
        "trainer.groups_per_step": 2,
        "trainer.total_steps": STEPS,
        "trainer.checkpoint.every": 0,
    }
    args = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]

    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "run", "examples/quickstart.yaml", *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward_mean" in r]
    assert len(rows) == STEPS
    assert all(r["episodes_invalid"] == 0 and r["reward_errors"] == 0 for r in rows)
    assert all(r["reward_mean"] == pytest.approx(0.5) for r in rows)  # the agent's own reward
    assert all(r["turns_mean"] > 1 for r in rows)  # sessions of three calls became multi-turn episodes
