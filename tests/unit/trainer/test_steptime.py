"""The step clock, the time shares over a run, and how readers report them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from relayrl.common.metrics_row import RlRow, format_time_shares, read_rows, time_shares
from relayrl.trainer.steptime import PARTS, StepClock


def test_clock_parts_and_other_add_up_to_the_wall_and_the_next_cycle_starts_at_close() -> None:
    clock = StepClock()
    with clock.part("data"):
        time.sleep(0.01)
    time.sleep(0.005)  # work timed elsewhere (the learner's thread) and added
    clock.add("fwd_bwd", 0.002)
    now = time.monotonic()

    times = clock.close(now)
    following = clock.close(now + 0.5)

    assert set(times.parts) == set(PARTS)
    assert times.parts["data"] >= 0.01 and times.parts["fwd_bwd"] == 0.002
    # float sums of three terms: 1e-12 s is far above rounding
    assert sum(times.parts.values()) + times.other == pytest.approx(times.wall, rel=0, abs=1e-12)
    assert following.wall == pytest.approx(0.5, rel=0, abs=1e-12) and sum(following.parts.values()) == 0


def test_a_part_that_raises_is_still_counted() -> None:
    clock = StepClock()
    with pytest.raises(RuntimeError), clock.part("publish"):
        raise RuntimeError("push failed")
    assert clock.close(time.monotonic()).parts["publish"] > 0


def _timed(step: int, wall: float, fwd: float, opt: float, publish: float, generating: float = 0.0) -> RlRow:
    other = wall - fwd - opt - publish - generating
    return RlRow(
        step=step,
        time_wall_s=wall,
        time_fwd_bwd_s=fwd,
        time_optimizer_s=opt,
        time_publish_s=publish,
        time_data_s=generating,
        time_data_generating_s=generating,
        time_other_s=other,
    )


def test_shares_are_over_the_whole_run_and_plumbing_is_all_but_compute_and_the_wait_for_generation() -> None:
    rows = [_timed(1, 1.0, 0.5, 0.1, 0.2), _timed(2, 3.0, 0.5, 0.1, 1.2, generating=1.0)]

    shares = time_shares(rows)

    # exact decimal fractions of small sums: 1e-12 absorbs binary rounding only
    assert shares["wall_s"] == pytest.approx(4.0, rel=0, abs=1e-12)
    assert shares["compute"] == pytest.approx(1.2 / 4.0, rel=0, abs=1e-12)
    assert shares["publication"] == pytest.approx(1.4 / 4.0, rel=0, abs=1e-12)
    assert shares["data_wait"] == shares["generation"] == pytest.approx(1.0 / 4.0, rel=0, abs=1e-12)
    assert shares["plumbing"] == pytest.approx(1 - 1.2 / 4.0 - 1.0 / 4.0, rel=0, abs=1e-12)
    line = format_time_shares(shares)
    assert "plumbing 45%" in line and "publication 35%" in line and "of the data wait, generation 25%" in line


def test_rows_without_a_breakdown_are_left_out_and_none_at_all_gives_no_shares(tmp_path: Path) -> None:
    old = {"step": 1, "reward_mean": 0.5, "time_s": 2.0}  # a row of a version without the breakdown
    new = _timed(2, 2.0, 1.0, 0.5, 0.25).to_json()
    (tmp_path / "m.jsonl").write_text(json.dumps(old) + "\n" + json.dumps(new) + "\n")

    rows = read_rows(tmp_path / "m.jsonl")

    assert rows[0].missing >= {"time_wall_s", "time_fwd_bwd_s"}
    assert time_shares(rows)["compute"] == pytest.approx(0.75, rel=0, abs=1e-12)  # exact binary fractions
    assert time_shares(rows[:1]) == {} and format_time_shares({}) == ""


def test_run_summary_and_status_report_the_shares(tmp_path: Path) -> None:
    from relayrl.run_report import run_summary
    from relayrl.status import _training, render

    rows = [_timed(1, 1.0, 0.5, 0.25, 0.125)]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0].to_json()) + "\n")

    summary = run_summary(list(rows), produced=1, stream_length=1, pending=0, durable_step=1)
    training = _training(tmp_path)

    assert summary["trainer_time"]["compute"] == 0.75 and summary["trainer_time"]["publication"] == 0.125
    assert json.loads(json.dumps(summary))["trainer_time"]["plumbing"] == 0.25
    assert "plumbing 25%" in render({"services": {}, "training": training})
