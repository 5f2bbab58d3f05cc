"""bench/ingest.py: its baseline and relayrl's ingest make the same batch from the same groups, and it prints the
ratio."""

from __future__ import annotations

import sys

import pytest
import torch

from relayrl.common.episodes import Limits
from relayrl.trainer.ingest import StepBatch
from tests.conftest import load_bench

ingest_bench = load_bench("ingest")


def test_the_baseline_and_relayrls_ingest_make_the_same_batch_and_the_bench_prints_their_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = ingest_bench.groups(3, 4, prompt=5, completion=2)
    ready = [ingest_bench.arrive(e, Limits(1000, 1000, 7)) for e in entries]
    laid = [(ing.columns, ingest_bench.list_positions(ing.columns.lists, ing.columns.temperature)) for ing in ready]
    argv = ["ingest.py", "--groups", "2", "--group-size", "2", "--prompt", "3", "--completion", "1", "--repeats", "3"]
    monkeypatch.setattr(sys, "argv", argv)

    batch, baseline = StepBatch.take(ready, {7: 0}), ingest_bench.list_take(laid, {7: 0})
    ingest_bench.main()

    p = batch.positions
    ours = [p.input_ids, p.targets, p.completion_at, p.lengths, p.mask, p.behaviour, p.temperature]
    ours += [batch.reward, batch.group_index, batch.completion_len, batch.staleness, batch.oldest, batch.newest]
    assert len(batch) == 12 and len(baseline) == len(ours) + 1
    for mine, theirs in zip(ours, baseline, strict=False):  # exact: the same values, laid out two ways
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    assert torch.equal(batch.counts, baseline[-1])
    out = capsys.readouterr().out
    assert "ingesting 2 x 2 episodes" in out and "ratio" in out
