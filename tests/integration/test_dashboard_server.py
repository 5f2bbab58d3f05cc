"""The dashboard's HTTP server on a real socket (port 0), in process and as `relayrl dashboard`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relayrl.dashboard import DashboardServer
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def _row(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "weight_version": step + 1,
        "reward_mean": 0.1 * step,
        "reward_std": 0.2,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "episodes_per_s": 100.0 + step,
        "tokens": 40,
        "time_s": 0.5 * step,
        "queue_lag": step % 3,
        "queue_pending": 8,
        "loss": 0.1,
    }


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def _metrics(base: str, offset: int = 0, file_id: str = "") -> dict[str, Any]:
    status, kind, body = _get(f"{base}api/metrics?offset={offset}&file={file_id}")
    assert status == 200 and kind == "application/json"
    data: dict[str, Any] = json.loads(body)
    return data


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "my-run"
    run.mkdir()
    (run / "config.yaml").write_text("rollout:\n  max_staleness: 2\n")
    return run


@pytest.fixture
def server(run_dir: Path) -> Iterator[DashboardServer]:
    with DashboardServer(run_dir, port=0) as srv:
        srv.start()
        yield srv


def test_metrics_endpoint_returns_the_complete_rows_then_only_new_ones(run_dir: Path, server: DashboardServer) -> None:
    metrics = run_dir / "metrics.jsonl"
    torn = json.dumps(_row(4)) + "\n"
    metrics.write_text("".join(json.dumps(_row(s)) + "\n" for s in (1, 2, 3)) + torn[:20])

    first = _metrics(server.url)
    with metrics.open("a") as f:
        f.write(torn[20:] + json.dumps(_row(5)) + "\n")
    second = _metrics(server.url, first["offset"], first["file"])
    idle = _metrics(server.url, second["offset"], second["file"])

    assert server.port > 0
    assert [r["step"] for r in first["rows"]] == [1, 2, 3]
    assert first["rows"][0] == {k: v for k, v in _row(1).items() if k != "loss"}
    assert (first["run"], first["max_staleness"], first["finished"], first["reset"]) == ("my-run", 2, False, False)
    assert [r["step"] for r in second["rows"]] == [4, 5] and not second["reset"]
    assert idle["rows"] == [] and idle["offset"] == metrics.stat().st_size


def test_an_empty_or_missing_metrics_file_returns_no_rows(run_dir: Path, server: DashboardServer) -> None:
    missing = _metrics(server.url)
    (run_dir / "metrics.jsonl").write_text("")
    empty = _metrics(server.url)

    assert missing["rows"] == [] and empty["rows"] == []
    assert missing["max_staleness"] == 2


def test_a_run_folder_that_does_not_exist_yet_is_served_as_waiting(tmp_path: Path) -> None:
    with DashboardServer(tmp_path / "later", port=0) as srv:
        srv.start()
        before = _metrics(srv.url)
        (tmp_path / "later").mkdir()
        (tmp_path / "later" / "metrics.jsonl").write_text(json.dumps(_row(1)) + "\n")
        after = _metrics(srv.url, before["offset"], before["file"])

    assert (before["rows"], before["run"], before["finished"]) == ([], "later", False)
    assert [r["step"] for r in after["rows"]] == [1]


def test_a_run_with_its_summary_written_after_the_metrics_is_finished(run_dir: Path, server: DashboardServer) -> None:
    (run_dir / "metrics.jsonl").write_text(json.dumps(_row(1)) + "\n")
    summary = {"groups_produced": 9, "groups_trained": 8, "groups_dropped_stale": 0, "groups_pending": 1}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    os.utime(run_dir / "metrics.jsonl", (time.time() - 10, time.time() - 10))

    data = _metrics(server.url)

    assert data["finished"] and data["summary"] == summary


def test_page_is_self_contained_and_unknown_paths_and_bad_offsets_are_errors(server: DashboardServer) -> None:
    status, kind, page = _get(server.url)
    bad_status, _, bad = _get(f"{server.url}api/metrics?offset=-3")
    missing_status, _, _ = _get(f"{server.url}nope")

    html = page.decode()
    assert status == 200 and kind.startswith("text/html")
    assert 'getContext("2d")' in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing fetched from elsewhere
    assert "fetch(" in html and "api/metrics" in html
    assert bad_status == 400 and b"offset" in bad
    assert missing_status == 404


def test_cli_prints_the_url_serves_the_run_and_stops_on_ctrl_c(run_dir: Path) -> None:
    (run_dir / "metrics.jsonl").write_text(json.dumps(_row(1)) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "dashboard", str(run_dir), "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        assert match, line
        rows = _metrics(match.group(1))["rows"]
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(15)
    _, err = proc.communicate()

    assert [r["step"] for r in rows] == [1]
    assert code == 0, err
    assert "stopped" in err and "Traceback" not in err


def test_cli_rejects_a_port_that_is_taken(run_dir: Path, server: DashboardServer) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "dashboard", str(run_dir), "--port", str(server.port)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert proc.returncode == 1
    assert "cannot serve the dashboard" in proc.stderr
