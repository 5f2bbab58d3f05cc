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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.trainer.logprobs import selected_logprobs


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

    def sequence_index(self) -> torch.Tensor:
        if self.seq is not None:
            return self.seq
        b, length = self.input_ids.shape
        return torch.arange(b, device=self.input_ids.device).unsqueeze(1).expand(b, length)

    def sequences(self) -> int:
        return self.num_seqs or int(self.input_ids.shape[0])


def pack(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
         behaviour: Sequence[Sequence[float]] | None, loss_masks: Sequence[Sequence[int]] | None,
         temperatures: Sequence[float], pad_id: int, device: torch.device) -> PackedBatch:
    """Rows padded to the longest sequence given (no further); one tensor built per field, on the host."""
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
    ids, attn, mask, old = [], [], [], []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        n_p, n_c = len(p), len(c)
        pad = length + 1 - n_p - n_c
        ids.append([*p, *c, *([pad_id] * pad)])
        attn.append([1] * (n_p + n_c) + [0] * pad)
        # completion token j sits at position n_p + j and is predicted from position n_p + j - 1
        lead, tail = [0.0] * (n_p - 1), [0.0] * (pad + 1)
        mask.append([*lead, *(loss_masks[i] if loss_masks is not None else [1] * n_c), *tail])
        old.append([*lead, *(behaviour[i] if behaviour is not None else [0.0] * n_c), *tail])
    ids_t = torch.tensor(ids, dtype=torch.long)
    return PackedBatch(
        input_ids=ids_t[:, :-1].to(device), attention_mask=torch.tensor(attn, dtype=torch.long)[:, :-1].to(device),
        targets=ids_t[:, 1:].to(device), mask=torch.tensor(mask, dtype=torch.float32)[:, :-1].to(device),
        behaviour_logprobs=torch.tensor(old, dtype=torch.float32)[:, :-1].to(device),
        temperature=torch.tensor(temperatures, dtype=torch.float32, device=device),
    )


def pack_row(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
             behaviour: Sequence[Sequence[float]] | None, loss_masks: Sequence[Sequence[int]] | None,
             temperatures: Sequence[float], device: torch.device) -> PackedBatch:
    """All sequences concatenated into one row ``[1, sum of (len - 1)]``, positions restarting at 0 for each."""
    ids: list[int] = []
    targets: list[int] = []
    mask: list[float] = []
    old: list[float] = []
    pos: list[int] = []
    seq: list[int] = []
    temp: list[float] = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        full = [*p, *c]
        n = len(full) - 1
        ids += full[:-1]
        targets += full[1:]
        lead = [0.0] * (len(p) - 1)
        mask += [*lead, *(float(x) for x in (loss_masks[i] if loss_masks is not None else [1] * len(c)))]
        old += [*lead, *(behaviour[i] if behaviour is not None else [0.0] * len(c))]
        pos += range(n)
        seq += [i] * n
        temp += [temperatures[i]] * n

    def row(values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([values], dtype=dtype, device=device)

    return PackedBatch(input_ids=row(ids, torch.long), attention_mask=None, targets=row(targets, torch.long),
                       mask=row(mask, torch.float32), behaviour_logprobs=row(old, torch.float32),
                       temperature=row(temp, torch.float32), seq=row(seq, torch.long),
                       position_ids=row(pos, torch.long), num_seqs=len(prompts))


def model_logprobs(model: Any, mb: PackedBatch, chunk: int = 0) -> torch.Tensor:
    """log pi(target) of ``mb`` (``[B, L]``): padded rows with their attention mask, packed rows with no mask and
    their position ids (transformers separates the sequences by them, but only without a KV cache:
    ``use_cache=False``, which a training forward never needs). ``chunk`` 0: at every position, from full
    ``[B, L, V]`` logits; ``chunk`` > 0: only where ``mb.mask`` is set, the log-softmax ``chunk`` positions at a
    time, the behaviour logprob elsewhere (relayrl.trainer.logprobs)."""
    return selected_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.targets, mb.temperature,
                             mb.mask, mb.behaviour_logprobs, chunk)


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
    return max(float((packed[:n0] - apart[0, :n0]).abs().max()),
               float((packed[n0:] - apart[1, : len(seqs[1]) - 1]).abs().max()))
