"""bench/ingest.py: both sides of its comparison take the same batch from the same groups, and it prints the ratio."""

from __future__ import annotations

import sys

import pytest
import torch

from relayrl.trainer.ingest import Ingested, StepBatch
from tests.conftest import load_bench

ingest_bench = load_bench("ingest")


def test_the_bench_times_the_same_batch_both_ways_and_prints_their_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = ingest_bench.groups(3, 4, prompt=5, completion=2)
    at_take = StepBatch.take([Ingested.of(e) for e in entries], {7: 0})
    joined = StepBatch.take([Ingested.of(e).valid() for e in entries], {7: 0})
    argv = ["ingest.py", "--groups", "2", "--group-size", "2", "--prompt", "3", "--completion", "1", "--repeats", "3"]
    monkeypatch.setattr(sys, "argv", argv)

    ingest_bench.main()

    assert len(joined) == len(at_take) == 12 and torch.equal(joined.positions.input_ids, at_take.positions.input_ids)
    out = capsys.readouterr().out
    assert "taking a batch of 2 x 2 episodes" in out and "ratio" in out
