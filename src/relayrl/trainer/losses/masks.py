"""Masks against the train/inference mismatch, chosen by ``trainer.loss.mismatch_mask`` independently of the
loss: tokens (or whole sequences) whose ratio pi_prox / pi_behav between the trainer's and inference's
probabilities falls outside ``[low, high]`` are left out of the loss (their tokens still count in the
normaliser). Formulas and papers: docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from relayrl.config.loss import MismatchMask
from relayrl.trainer.losses.tokens import Tokens

MaskFn = Callable[[Tokens, float, float], torch.Tensor]
MASKS: dict[MismatchMask, MaskFn] = {}


def register(kind: MismatchMask) -> Callable[[MaskFn], MaskFn]:
    def wrap(fn: MaskFn) -> MaskFn:
        MASKS[kind] = fn
        return fn

    return wrap


def _log_ratio(t: Tokens) -> torch.Tensor:
    return (t.prox - t.behaviour).detach().to(torch.float64)


def _inside(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    # compared in log space: exp of a sequence's summed log ratio overflows long before it matters
    return (log_ratio >= torch.log(torch.tensor(low, dtype=torch.float64))) & (
        log_ratio <= torch.log(torch.tensor(high, dtype=torch.float64))
    )


@register(MismatchMask.NONE)
def no_mask(t: Tokens, low: float, high: float) -> torch.Tensor:
    return t.mask


@register(MismatchMask.TOKEN)
def token_mask(t: Tokens, low: float, high: float) -> torch.Tensor:
    """IcePop (Ling Team 2025): keep token t only if low <= pi_prox / pi_behav <= high."""
    return t.mask * _inside(_log_ratio(t), low, high).to(t.mask.dtype)


@register(MismatchMask.SEQUENCE)
def sequence_mask(t: Tokens, low: float, high: float) -> torch.Tensor:
    """Sequence-level masked importance sampling: keep sequence i only if low <= prod_t pi_prox / pi_behav <= high."""
    keep = _inside(t.seq_sum(_log_ratio(t)), low, high)
    return t.mask * keep[t.seq].to(t.mask.dtype)


@register(MismatchMask.GEOMETRIC)
def geometric_mask(t: Tokens, low: float, high: float) -> torch.Tensor:
    """Geometric-mean mask: keep sequence i only if low <= exp(mean_t log(pi_prox / pi_behav)) <= high."""
    keep = _inside(t.seq_sum(_log_ratio(t)) / t.seq_lengths().to(torch.float64), low, high)
    return t.mask * keep[t.seq].to(t.mask.dtype)


def mismatch_mask(kind: MismatchMask, t: Tokens, low: float, high: float) -> torch.Tensor:
    """The loss mask after the mismatch mask ``kind`` (a new tensor or ``t.mask`` itself for none)."""
    if kind not in MASKS:
        raise ValueError(f"unknown mismatch mask {kind}")
    return MASKS[kind](t, low, high)
