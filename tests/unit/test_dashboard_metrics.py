"""Reading metrics.jsonl for the dashboard: complete lines only, incrementally, across a replaced file."""

from __future__ import annotations

import json
from pathlib import Path

from relayrl.dashboard import read_metrics_chunk


def _line(step: int, **extra: object) -> str:
    return json.dumps({"step": step, "reward_mean": step / 10, "staleness_max": 1, "loss": 0.5, **extra}) + "\n"


def test_a_torn_last_line_is_left_for_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    complete = _line(1) + _line(2)
    torn = _line(3)
    path.write_text(complete + torn[:15])

    first = read_metrics_chunk(path)
    with path.open("a") as f:
        f.write(torn[15:])
    second = read_metrics_chunk(path, first.offset, first.file_id)

    assert [r["step"] for r in first.rows] == [1, 2]
    assert first.offset == len(complete.encode())
    assert not first.reset and first.bad_lines == 0
    assert [r["step"] for r in second.rows] == [3]
    assert second.offset == path.stat().st_size and not second.reset


def test_rows_keep_only_drawn_fields_skip_warmup_and_bad_lines_and_null_non_finite_values(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        json.dumps({"phase": "sft", "sft_step": 1, "loss": 2.0})
        + "\n"
        + "not json\n"
        + "[1, 2]\n"
        + "\n"
        + _line(1, queue_lag=3, queue_pending=None).replace("0.1", "NaN")
    )

    chunk = read_metrics_chunk(path)

    # NaN is sent as null; a null in the file reads as a value the row lacks (the page draws a gap for both)
    assert chunk.rows == [{"step": 1, "reward_mean": None, "staleness_max": 1, "queue_lag": 3}]
    assert chunk.bad_lines == 2


def test_a_replaced_or_shorter_file_is_read_again_from_its_start(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_line(s, time_s=1.0 * s) for s in (1, 2, 3)))
    old = read_metrics_chunk(path)
    path.unlink()  # a fresh run in the same folder: a new file (same inode, likely), longer than the old offset
    path.write_text("".join(_line(s, time_s=0.7 * s) for s in range(1, 6)))

    replaced = read_metrics_chunk(path, old.offset, old.file_id)
    shorter = read_metrics_chunk(path, replaced.offset + 100)

    assert replaced.reset and [r["step"] for r in replaced.rows] == [1, 2, 3, 4, 5]
    assert replaced.file_id != old.file_id
    assert shorter.reset and len(shorter.rows) == 5


def test_a_missing_file_reads_as_empty_and_resets_a_reader_that_had_rows(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"

    fresh = read_metrics_chunk(path)
    after_rows = read_metrics_chunk(path, 120, "1-2")

    assert (fresh.rows, fresh.offset, fresh.reset) == ([], 0, False)
    assert (after_rows.rows, after_rows.offset, after_rows.reset) == ([], 0, True)
