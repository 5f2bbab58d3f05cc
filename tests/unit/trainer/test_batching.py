"""Micro-batch plans: by sequences or by a token budget, sorted by length (hypothesis properties)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.trainer.batching import padded_tokens, plan_micro_batches

lengths_st = st.lists(st.integers(1, 64), min_size=0, max_size=80)


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, size=st.integers(1, 16), budget=st.integers(0, 512))
def test_every_sequence_is_in_exactly_one_micro_batch_in_ascending_length(
    lengths: list[int], size: int, budget: int
) -> None:
    plan = plan_micro_batches(lengths, size, budget)

    flat = [i for mb in plan for i in mb]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths)
    assert all(plan)  # no empty micro-batch: padding ones are the learner's business


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 512))
def test_a_token_budget_bounds_each_micro_batch_unless_one_sequence_exceeds_it(lengths: list[int], budget: int) -> None:
    plan = plan_micro_batches(lengths, micro_batch_size=1, micro_batch_tokens=budget)

    for mb in plan:
        assert len(mb) * max(lengths[i] for i in mb) <= budget or len(mb) == 1
    # greedy: a micro-batch closes only when the next (longer) sequence would not fit
    for mb, nxt in pairwise(plan):
        assert (len(mb) + 1) * lengths[nxt[0]] > budget


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, size=st.integers(1, 16), budget=st.integers(0, 512))
def test_sorted_micro_batches_never_compute_more_positions_than_one_padded_batch(
    lengths: list[int], size: int, budget: int
) -> None:
    plan = plan_micro_batches(lengths, size, budget)

    assert padded_tokens(lengths, plan) <= len(lengths) * max(lengths, default=0)


def test_by_sequences_the_split_keeps_micro_batch_size_rows() -> None:
    plan = plan_micro_batches([5, 1, 4, 2, 3], micro_batch_size=2)

    assert plan == [[1, 3], [4, 2], [0]]  # lengths [1, 2], [3, 4], [5]
    assert padded_tokens([5, 1, 4, 2, 3], plan) == 2 * 2 + 2 * 4 + 5


def test_by_tokens_short_sequences_share_a_micro_batch_and_a_long_one_goes_alone() -> None:
    plan = plan_micro_batches([2, 2, 2, 2, 10], micro_batch_size=1, micro_batch_tokens=8)

    assert plan == [[0, 1, 2, 3], [4]]


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        plan_micro_batches([1], 1, -1)
