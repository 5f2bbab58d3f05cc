"""Checks shared by the multi-turn examples' end-to-end tests: the episodes a run's trainer trained on, as it dumps
them (trainer.dump_episodes: protobuf JSON, one line each), against the token contract of episode.proto and
relayrl.rollout.workflows.trajectory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from relayrl.tasks.calculator import TAGGED_CLOSE, TAGGED_OPEN
from tests.conftest import REPO


def run_example(config: str, model: Path, steps: int, dumped: int, out: Path) -> list[dict[str, Any]]:
    """``relayrl run config`` on ``model`` for ``steps`` steps, dumping ``dumped`` trained episodes per step, into
    ``out``, as a user runs it; the run must succeed and write one metrics row per step, which come back."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "run",
            config,
            "--set",
            f"model.path={model}",
            "--set",
            f"trainer.total_steps={steps}",
            "--set",
            f"trainer.dump_episodes={dumped}",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps
    return rows


def dumped_episodes(run: Path, rank: int = 0) -> list[dict[str, Any]]:
    """What the trainer of the run in ``run`` wrote out with trainer.dump_episodes."""
    path = run / "trained" / "episodes" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def versions(ep: dict[str, Any]) -> list[int]:
    return [int(v) for v in ep.get("token_weight_versions", [])]  # int64: strings in protobuf JSON


def mask_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(mask, start, end) of each run of equal mask values: the model's turns (1) and the tools' outputs (0)."""
    runs: list[list[int]] = []
    for i, m in enumerate(mask):
        if runs and runs[-1][0] == m:
            runs[-1][2] = i + 1
        else:
            runs.append([m, i, i + 1])
    return [(m, start, end) for m, start, end in runs]


def check_episode(ep: dict[str, Any], tok: Any) -> None:
    """One episode of the tools workflow (tagged tool format): one run of mask 1 per model turn, trained on and
    stamped with the version that sampled it; each tool output <r>...</r> not trained on (mask 0, logprob 0) and
    stamped with the version of the model token before it; versions never going down, turn after turn; the tokens
    decoding to the transcript (a prefix of it when a turn was cut to fit the episode)."""
    ids, mask, lps = (ep.get(k, []) for k in ("completion_token_ids", "loss_mask", "behaviour_logprobs"))
    stamped = versions(ep)  # (protobuf JSON leaves out empty and zero fields)
    assert len(ids) == len(mask) == len(lps) == len(stamped), ep["episode_id"]
    runs = mask_runs(mask)
    assert runs[0][0] == 1 and sum(m for m, _, _ in runs) == ep.get("turns", 1), ep  # one run per model turn
    for m, start, end in runs:
        if m == 0:
            text = tok.decode(ids[start:end], skip_special_tokens=True)
            assert text.startswith(TAGGED_OPEN) and TAGGED_CLOSE in text, text
            assert all(lp == 0.0 for lp in lps[start:end]) and set(stamped[start:end]) == {stamped[start - 1]}
    assert stamped == sorted(stamped), stamped
    whole = tok.decode(ids, skip_special_tokens=True)
    if ep.get("episode_end") == "EPISODE_END_MAX_TOKENS":
        assert ep.get("completion_text", "").startswith(whole)
    else:
        assert whole == ep.get("completion_text", "")


def check_versions_per_step(rows: list[dict[str, Any]], dumped: list[dict[str, Any]], per_step: int) -> None:
    """The dumped sample (``per_step`` episodes of each step, in step order) against the metrics rows: no step's
    sample holds more multi-version episodes than its row counted, and the versions the trainer trained on advance
    over the run. Whether a swap lands mid-episode at all depends on timing (0 in 150 steps in a CI run): the
    deterministic case is tests/integration/test_multi_turn_inference.py."""
    assert len(dumped) == per_step * len(rows)
    for step, row in enumerate(rows):
        sample = dumped[step * per_step : (step + 1) * per_step]
        seen = sum(len(set(versions(ep))) > 1 for ep in sample)
        assert seen <= row["episodes_multi_version"] <= row["episodes"], (step + 1, seen, row["episodes_multi_version"])
    first, last = (
        max(max(versions(ep), default=0) for ep in dumped[i : i + per_step]) for i in (0, len(dumped) - per_step)
    )
    assert last > first, (first, last)
