"""Micro-batch plans: by sequences or by a token budget, sorted by length (hypothesis properties)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.trainer.batching import Positions, padded_tokens, plan_micro_batches

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


def _reference_layout(
    prompts: list[list[int]],
    completions: list[list[int]],
    behaviour: list[list[float]] | None,
    masks: list[list[int]] | None,
) -> dict[str, list[float]]:
    """The positions stated one sequence at a time: position t reads token t and predicts token t + 1; completion
    values sit where their token is predicted, 0 (completion index -1) under the prompt."""
    out: dict[str, list[float]] = {k: [] for k in ("ids", "targets", "mask", "behaviour", "completion_at", "lengths")}
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        full, lead = p + c, len(p) - 1
        out["ids"] += full[:-1]
        out["targets"] += full[1:]
        out["lengths"].append(lead + len(c))
        out["mask"] += [0.0] * lead + ([float(m) for m in masks[i]] if masks is not None else [1.0] * len(c))
        out["behaviour"] += [0.0] * lead + (behaviour[i] if behaviour is not None else [0.0] * len(c))
        out["completion_at"] += [-1] * lead + list(range(len(c)))
    return out


@st.composite
def _sequences(
    draw: st.DrawFn,
) -> tuple[list[list[int]], list[list[int]], list[list[float]] | None, list[list[int]] | None]:
    n = draw(st.integers(0, 6))
    prompts = [draw(st.lists(st.integers(0, 99), min_size=1, max_size=5)) for _ in range(n)]
    completions = [draw(st.lists(st.integers(0, 99), max_size=4)) for _ in range(n)]
    logprob = st.floats(-20, 0, width=32)
    behaviour = [draw(st.lists(logprob, min_size=len(c), max_size=len(c))) for c in completions]
    masks = [draw(st.lists(st.integers(0, 1), min_size=len(c), max_size=len(c))) for c in completions]
    return prompts, completions, draw(st.none() | st.just(behaviour)), draw(st.none() | st.just(masks))


@settings(max_examples=300, deadline=None)
@given(_sequences())
def test_positions_laid_out_as_arrays_are_the_positions_stated_one_sequence_at_a_time(
    sequences: tuple[list[list[int]], list[list[int]], list[list[float]] | None, list[list[int]] | None],
) -> None:
    prompts, completions, behaviour, masks = sequences
    laid = Positions.of(prompts, completions, behaviour, masks, [1.0] * len(prompts))

    expected = _reference_layout(prompts, completions, behaviour, masks)
    # exact: the arrays hold the same values (float32 logprobs drawn as float32, masks 0/1), only laid out at once
    for name, column in (
        ("ids", "input_ids"),
        ("targets", "targets"),
        ("mask", "mask"),
        ("behaviour", "behaviour"),
        ("completion_at", "completion_at"),
        ("lengths", "lengths"),
    ):
        assert getattr(laid, column).tolist() == expected[name], name


def test_an_empty_prompt_or_a_loss_mask_of_another_length_is_refused_by_the_layout() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        Positions.of([[1], []], [[2], [3]], None, None, [1.0, 1.0])
    with pytest.raises(ValueError, match="loss mask"):
        Positions.of([[1]], [[2, 3]], None, [[1]], [1.0])
