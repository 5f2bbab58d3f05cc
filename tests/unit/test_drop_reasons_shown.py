"""Every reason a group leaves the books (stale, reward errors, zero advantage under DAPO's dynamic sampling,
invalid) reaches what people read: `relayrl status`'s trainer line, the run's summary line and the dashboard."""

from __future__ import annotations

import json
from pathlib import Path

from relayrl.common.metrics_row import format_books
from relayrl.dashboard import DashboardServer
from relayrl.status import render

SUMMARY = {
    "groups_produced": 30,
    "groups_foreign": 0,
    "groups_trained": 20,
    "groups_dropped_stale": 1,
    "groups_dropped_reward_error": 2,
    "groups_dropped_zero_advantage": 4,
    "groups_invalid": 1,
    "groups_pending": 2,
}


def test_the_trainer_status_line_counts_every_drop_reason() -> None:
    trainer = {
        "address": "127.0.0.1:1",
        "step": 3,
        "weight_version": 4,
        "episodes_trained": 96,
        "episodes_dropped_stale": 1,
        "episodes_dropped_reward_error": 2,
        "episodes_dropped_zero_advantage": 16,
        "episodes_invalid": 5,
    }

    line = render({"services": {"trainer": trainer}})

    assert (
        "96 episodes trained, 1 dropped as stale, 2 dropped for reward errors, 16 dropped with zero advantage, "
        "5 invalid"
    ) in line


def test_the_books_line_names_every_outcome_and_counts_a_missing_one_as_zero() -> None:
    old = {k: v for k, v in SUMMARY.items() if k != "groups_dropped_zero_advantage"}  # an older summary.json

    assert format_books(SUMMARY) == (
        "groups produced 30 = trained 20 + dropped as stale 1 + dropped for reward "
        "errors 2 + dropped with zero advantage 4 + invalid 1 + pending 2"
    )
    assert "dropped with zero advantage 0 + invalid 1" in format_books(old)
    assert format_books({**SUMMARY, "groups_foreign": 3}).startswith("groups produced 30 (+ 3 appended by others) =")


def test_the_dashboard_of_a_finished_run_shows_the_books_with_the_zero_advantage_drops(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))

    with DashboardServer(tmp_path, port=0) as server:
        live = server.snapshot(0, "")

    assert live["finished"] and "dropped with zero advantage 4" in live["books"]
    assert "info.books" in (Path(__file__).parents[2] / "src/relayrl/dashboard/page.html").read_text()
