"""Rollout progress bookkeeping (the watermark and the done set)."""

from __future__ import annotations

from relayrl.rollout.progress import Progress


def test_out_of_order_completions_advance_the_watermark_only_over_a_contiguous_prefix() -> None:
    p = Progress()

    assert p.mark(1) == []
    assert p.mark(2) == []
    assert p.mark(0) == [0, 1, 2]
    assert p.mark(4) == []

    assert p.watermark == 3 and p.done == {4}
    assert p.next_seq() == 5
    assert p.missing() == [3]  # admitted before a restart but never recorded: generate it again


def test_fresh_progress_starts_at_zero_with_nothing_missing() -> None:
    p = Progress()

    assert (p.next_seq(), p.missing()) == (0, [])
