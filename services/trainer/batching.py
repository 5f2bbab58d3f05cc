"""Splitting a rank's batch into micro-batches: by sequences or by a token budget, shortest sequences first.

Each micro-batch is padded only to its own longest sequence (see Learner.rl_gradients), so grouping sequences
of similar length wastes less compute on padding. The split never changes the loss: every micro-batch's token
sum is divided by the one global normaliser, so any partition of the batch gives the same gradient (up to
float summation order).

- by sequences (``micro_batch_tokens == 0``): sequences sorted by length, ``micro_batch_size`` per micro-batch;
- by tokens (``micro_batch_tokens > 0``): sequences sorted by length, each micro-batch filled while its padded
  size (rows x its longest sequence) stays within the budget; a sequence longer than the budget alone makes a
  micro-batch (it is never dropped or cut).

Ranks may end with different counts; Learner agrees on the most any rank has (all-reduce MAX) and pads.
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_micro_batches(lengths: Sequence[int], micro_batch_size: int, micro_batch_tokens: int = 0
                       ) -> list[list[int]]:
    """Indices of the sequences of each micro-batch, in ascending length order; every index exactly once.

    ``lengths`` are the padded-row lengths of the sequences (prompt + completion - 1 positions).
    """
    if micro_batch_size < 1 or micro_batch_tokens < 0:
        raise ValueError(f"micro_batch_size {micro_batch_size} must be >= 1 and micro_batch_tokens "
                         f"{micro_batch_tokens} >= 0")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if micro_batch_tokens == 0:
        return [order[s : s + micro_batch_size] for s in range(0, len(order), micro_batch_size)]
    plan: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending: the newest sequence is the longest of its micro-batch
        if current and (len(current) + 1) * lengths[i] > micro_batch_tokens:
            plan.append(current)
            current = []
        current.append(i)
    if current:
        plan.append(current)
    return plan


def padded_tokens(lengths: Sequence[int], plan: Sequence[Sequence[int]]) -> int:
    """Positions the forward passes of ``plan`` compute (rows x longest, summed over micro-batches)."""
    return sum(len(mb) * max(lengths[i] for i in mb) for mb in plan if mb)
