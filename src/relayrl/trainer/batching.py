"""Splitting a rank's batch into micro-batches, and building their tensors: padded rows or packed rows.

Plans (lists of sequence indices per micro-batch; every index exactly once):

- by sequences (``micro_batch_tokens == 0``): sequences sorted by length, ``micro_batch_size`` per micro-batch,
  each padded to its own longest;
- by tokens (``micro_batch_tokens > 0``, layout ``padded``): sequences sorted by length, each micro-batch filled
  while its padded size (rows x its longest sequence) stays within the budget;
- packed (layout ``packed``): sequences concatenated into one row per micro-batch of at most
  ``micro_batch_tokens`` positions (first-fit decreasing), each with its own position ids from 0; the model
  sees no attention mask, so transformers derives a block-diagonal causal mask from the position ids (no
  token attends across sequences) and no position is padding.

A sequence longer than the budget alone makes a micro-batch (never dropped or cut). The split never changes
the loss: every micro-batch's token sum is divided by the one global normaliser. Ranks may end with different
counts; Learner agrees on the most any rank has (all-reduce MAX) and pads with zero-weight micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from relayrl.trainer.logprobs import selected_logprobs


def plan_micro_batches(lengths: Sequence[int], micro_batch_size: int, micro_batch_tokens: int = 0) -> list[list[int]]:
    """Indices of the sequences of each micro-batch, in ascending length order; every index exactly once.

    ``lengths`` are the padded-row lengths of the sequences (prompt + completion - 1 positions).
    """
    if micro_batch_size < 1 or micro_batch_tokens < 0:
        raise ValueError(
            f"micro_batch_size {micro_batch_size} must be >= 1 and micro_batch_tokens {micro_batch_tokens} >= 0"
        )
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


def plan_packed(lengths: Sequence[int], micro_batch_tokens: int) -> list[list[int]]:
    """First-fit decreasing: each micro-batch one packed row of at most ``micro_batch_tokens`` positions."""
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens {micro_batch_tokens} must be >= 1 for packed micro-batches")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(micro_batch_tokens - lengths[i])
    return rows


def padded_tokens(lengths: Sequence[int], plan: Sequence[Sequence[int]]) -> int:
    """Positions the forward passes of a padded ``plan`` compute (rows x longest, summed over micro-batches)."""
    return sum(len(mb) * max(lengths[i] for i in mb) for mb in plan if mb)


@dataclass
class PackedBatch:
    """Sequences (prompt + completion) with the completion tokens' targets aligned, as rows ``[B, L]``.

    Position t of ``input_ids`` predicts ``targets[:, t]``; ``mask`` marks the completion tokens trained on;
    ``seq`` names the micro-batch's sequence each position belongs to (its row when padded).
    ``attention_mask`` is None and ``position_ids`` set when several sequences share a row (packed).
    ``teacher``, ``reference`` and ``baseline`` are other per-token values, laid out like ``behaviour_logprobs``.
    """

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor | None  # [B, L] long (padded rows) or None (packed)
    targets: torch.Tensor  # [B, L] long
    mask: torch.Tensor  # [B, L] float
    behaviour_logprobs: torch.Tensor  # [B, L] float
    temperature: torch.Tensor  # [B] float (padded rows) or [B, L] (packed: per position)
    seq: torch.Tensor | None = None  # [B, L] long: sequence index (None: the row)
    position_ids: torch.Tensor | None = None  # [B, L] long (packed)
    num_seqs: int = 0
    teacher: torch.Tensor | None = None  # [B, L] float: the teacher's logprob of each target
    reference: torch.Tensor | None = None  # [B, L] float: the reference endpoint's logprob of each target
    baseline: torch.Tensor | None = None  # [B, L] float: the distillation baseline of each token

    def sequence_index(self) -> torch.Tensor:
        if self.seq is not None:
            return self.seq
        b, length = self.input_ids.shape
        return torch.arange(b, device=self.input_ids.device).unsqueeze(1).expand(b, length)

    def sequences(self) -> int:
        return self.num_seqs or int(self.input_ids.shape[0])


PerToken = Sequence[Sequence[float]]  # one list per sequence, one value per completion token


def _flat(parts: Iterable[Iterable[Any]], dtype: Any, count: int) -> np.ndarray:
    return np.fromiter(chain.from_iterable(parts), dtype, count)


@dataclass(frozen=True)
class Positions:
    """Sequences as training positions, flat and on the host, built once per batch: sequence i holds positions
    ``starts[i] : starts[i] + lengths[i]`` (prompt + completion - 1 of them), where position t reads token t and
    predicts token t + 1. Completion values (behaviour logprobs, loss mask, teacher, reference, baseline) sit at
    the positions that predict their tokens, 0 under the prompt. A micro-batch is a gather of its sequences'
    spans (:meth:`padded`, :meth:`packed`): nothing is re-read from the episodes."""

    input_ids: torch.Tensor  # [T] long
    targets: torch.Tensor  # [T] long
    mask: torch.Tensor  # [T] float32
    behaviour: torch.Tensor  # [T] float32
    temperature: torch.Tensor  # [N] float32
    lengths: torch.Tensor  # [N] long
    sizes: tuple[int, ...]  # the same lengths as host integers (plans and shapes need no tensor read)
    starts: torch.Tensor  # [N] long
    completion_at: torch.Tensor  # [T] long: the completion token a position predicts (-1 under the prompt)
    teacher: torch.Tensor | None = None  # [T] float32
    reference: torch.Tensor | None = None  # [T] float32
    baseline: torch.Tensor | None = None  # [T] float32

    @classmethod
    def of(
        cls,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        behaviour: PerToken | None,
        loss_masks: Sequence[Sequence[int]] | None,
        temperatures: Sequence[float],
    ) -> Positions:
        """The sequences laid out at once, a few array operations whatever their number, one tensor per column
        (behaviour logprobs 0 and every completion token in the loss where not given)."""
        n = len(prompts)
        if len(completions) != n or len(temperatures) != n:
            raise ValueError(f"{n} prompts, {len(completions)} completions and {len(temperatures)} temperatures")
        plen = np.fromiter(map(len, prompts), np.int64, n)
        clen = np.fromiter(map(len, completions), np.int64, n)
        for name, values in (("loss mask", loss_masks), ("behaviour logprobs", behaviour)):
            if values is not None and (len(values) != n or list(map(len, values)) != clen.tolist()):
                raise ValueError(f"a {name} whose length is not its completion's")
        if n and plen.min() < 1:
            raise ValueError(f"sequence {int(np.argmin(plen))}: an empty prompt")
        total, ncomp = int(plen.sum() + clen.sum()), int(clen.sum())
        full = _flat(chain.from_iterable(zip(prompts, completions, strict=True)), np.int64, total)
        ends = np.cumsum(plen + clen)
        last, first = np.ones(total, bool), np.ones(total, bool)
        last[ends - 1], first[ends - plen - clen] = False, False
        lengths = plen + clen - 1
        # position of completion token k of sequence i: its sequence's first position + its prompt's length - 1 + k
        k = np.arange(ncomp) - np.repeat(np.cumsum(clen) - clen, clen)
        at = np.repeat(np.cumsum(lengths) - lengths + plen - 1, clen) + k
        positions = int(lengths.sum())
        mask, logprobs = np.zeros(positions, np.float32), np.zeros(positions, np.float32)
        mask[at] = 1.0 if loss_masks is None else _flat(loss_masks, np.float32, ncomp)
        if behaviour is not None:
            logprobs[at] = _flat(behaviour, np.float32, ncomp)
        completion_at = np.full(positions, -1, np.int64)
        completion_at[at] = k
        length_t = torch.from_numpy(lengths)
        return cls(  # tensors sharing the arrays' memory (nothing downstream writes into them)
            input_ids=torch.from_numpy(full[last]),
            targets=torch.from_numpy(full[first]),
            mask=torch.from_numpy(mask),
            behaviour=torch.from_numpy(logprobs),
            temperature=torch.from_numpy(np.asarray(temperatures, np.float32)),
            lengths=length_t,
            sizes=tuple(lengths.tolist()),
            starts=torch.cumsum(length_t, 0) - length_t,
            completion_at=torch.from_numpy(completion_at),
        )

    def completion_values(self, per_token: PerToken) -> torch.Tensor:
        """Values of each sequence's completion tokens (one list per sequence, one value per token: a teacher's or
        a reference's logprobs), laid out as positions: 0 under the prompt. A list of the wrong length is an
        error."""
        column = torch.zeros(len(self.mask), dtype=torch.float32)
        values = torch.tensor([v for seq in per_token for v in seq], dtype=torch.float32)
        try:
            column[self.completion_at >= 0] = values
        except RuntimeError as exc:  # a shape mismatch: some list is not as long as its completion
            raise ValueError(f"{len(values)} per-token values do not match the completion tokens: {exc}") from None
        return column

    def padded(self, rows: Sequence[int], pad_id: int, device: torch.device) -> PackedBatch:
        """Sequences ``rows``, one per row, right-padded to the longest of them (no further)."""
        index = torch.tensor(list(rows), dtype=torch.long)
        n = self.lengths[index]
        span = torch.arange(max(self.sizes[i] for i in rows))
        valid = span.unsqueeze(0) < n.unsqueeze(1)
        at = torch.where(valid, self.starts[index].unsqueeze(1) + span, 0)  # [B, L] flat position (0: padding)

        def take(col: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
            return torch.where(valid, col[at], fill).to(device)

        def maybe(col: torch.Tensor | None) -> torch.Tensor | None:
            return None if col is None else take(col)

        return PackedBatch(
            input_ids=take(self.input_ids, pad_id),
            attention_mask=valid.long().to(device),
            targets=take(self.targets, pad_id),
            mask=take(self.mask),
            behaviour_logprobs=take(self.behaviour),
            temperature=self.temperature[index].to(device),
            teacher=maybe(self.teacher),
            reference=maybe(self.reference),
            baseline=maybe(self.baseline),
        )

    def packed(self, rows: Sequence[int], device: torch.device) -> PackedBatch:
        """Sequences ``rows`` concatenated into one row ``[1, sum of their lengths]``, positions from 0 for each."""
        index = torch.tensor(list(rows), dtype=torch.long)
        n = self.lengths[index]
        seq = torch.repeat_interleave(torch.arange(len(index)), n)
        pos = torch.arange(sum(self.sizes[i] for i in rows)) - (torch.cumsum(n, 0) - n)[seq]
        at = self.starts[index][seq] + pos

        def row(values: torch.Tensor) -> torch.Tensor:
            return values.unsqueeze(0).to(device)

        def take(col: torch.Tensor) -> torch.Tensor:
            return row(col[at])

        def maybe(col: torch.Tensor | None) -> torch.Tensor | None:
            return None if col is None else take(col)

        return PackedBatch(
            input_ids=take(self.input_ids),
            attention_mask=None,
            targets=take(self.targets),
            mask=take(self.mask),
            behaviour_logprobs=take(self.behaviour),
            temperature=row(self.temperature[index][seq]),
            seq=row(seq),
            position_ids=row(pos),
            num_seqs=len(index),
            teacher=maybe(self.teacher),
            reference=maybe(self.reference),
            baseline=maybe(self.baseline),
        )


def pack(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    behaviour: PerToken | None,
    loss_masks: Sequence[Sequence[int]] | None,
    temperatures: Sequence[float],
    pad_id: int,
    device: torch.device,
) -> PackedBatch:
    """All sequences, one per row, padded to the longest (:meth:`Positions.padded`)."""
    positions = Positions.of(prompts, completions, behaviour, loss_masks, temperatures)
    return positions.padded(range(len(prompts)), pad_id, device)


def pack_row(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    behaviour: PerToken | None,
    loss_masks: Sequence[Sequence[int]] | None,
    temperatures: Sequence[float],
    device: torch.device,
) -> PackedBatch:
    """All sequences concatenated into one row (:meth:`Positions.packed`)."""
    return Positions.of(prompts, completions, behaviour, loss_masks, temperatures).packed(range(len(prompts)), device)


def model_logprobs(model: Any, mb: PackedBatch, chunk: int = 0) -> torch.Tensor:
    """log pi(target) of ``mb`` (``[B, L]``): padded rows with their attention mask, packed rows with no mask and
    their position ids (transformers separates the sequences by them, but only without a KV cache:
    ``use_cache=False``, which a training forward never needs). ``chunk`` 0: at every position, from full
    ``[B, L, V]`` logits; ``chunk`` > 0: only where ``mb.mask`` is set, the log-softmax ``chunk`` positions at a
    time, the behaviour logprob elsewhere (relayrl.trainer.logprobs)."""
    return selected_logprobs(
        model,
        mb.input_ids,
        mb.attention_mask,
        mb.position_ids,
        mb.targets,
        mb.temperature,
        mb.mask,
        mb.behaviour_logprobs,
        chunk,
    )


def packing_error(model: Any, device: torch.device) -> float:
    """Largest |logprob difference| between two short sequences scored packed in one row and apart: about 0
    for a model whose attention honours packed position ids, large for one that attends across sequences."""
    vocab = int(model.get_input_embeddings().num_embeddings)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 9)]
    prompts, completions = [s[:2] for s in seqs], [s[2:] for s in seqs]
    with torch.no_grad():
        apart = model_logprobs(model, pack(prompts, completions, None, None, [1.0, 1.0], 0, device))
        packed = model_logprobs(model, pack_row(prompts, completions, None, None, [1.0, 1.0], device))[0]
    n0 = len(seqs[0]) - 1
    return max(
        float((packed[:n0] - apart[0, :n0]).abs().max()),
        float((packed[n0:] - apart[1, : len(seqs[1]) - 1]).abs().max()),
    )
