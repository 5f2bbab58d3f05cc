"""Advantage estimators: a registry of pure functions chosen by ``trainer.loss.advantage``.

Every estimator maps per-episode rewards ``[N]`` and their group index ``[N]`` (long, in ``[0, num_groups)``)
to per-episode advantages ``[N]``. Group statistics are computed in float64. The two REINFORCE++ variants
normalise over the whole batch; with several ranks the batch moments of every rank are passed in
(``batch_moments``: count, sum, sum of squares of the values to normalise, summed over ranks by the caller), so
1 rank and N ranks give the same advantages. Formulas and papers: docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from relayrl.config.loss import AdvantageEstimator


@dataclass(frozen=True)
class Groups:
    """Per-episode rewards and their groups."""

    rewards: torch.Tensor  # [N] float
    index: torch.Tensor  # [N] long
    count: int  # number of groups

    def stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rewards in float64, members per group [G], reward sum per group [G])."""
        r = self.rewards.to(torch.float64)
        n = torch.zeros(self.count, dtype=r.dtype, device=r.device).index_add_(0, self.index, torch.ones_like(r))
        total = torch.zeros_like(n).index_add_(0, self.index, r)
        return r, n, total


Estimator = Callable[[Groups, float, "torch.Tensor | None"], torch.Tensor]
ESTIMATORS: dict[AdvantageEstimator, Estimator] = {}
BATCH_NORMALISED = frozenset({AdvantageEstimator.REINFORCE_PP, AdvantageEstimator.REINFORCE_PP_BASELINE})


def register(kind: AdvantageEstimator) -> Callable[[Estimator], Estimator]:
    def wrap(fn: Estimator) -> Estimator:
        ESTIMATORS[kind] = fn
        return fn

    return wrap


def _centred(g: Groups) -> torch.Tensor:
    r, n, total = g.stats()
    return r - (total / n)[g.index]


@register(AdvantageEstimator.GRPO)
def grpo(g: Groups, eps: float, batch_moments: torch.Tensor | None = None) -> torch.Tensor:
    """(r - group mean) / (group population std + eps) (Shao et al. 2024, DeepSeekMath)."""
    centred = _centred(g)
    _, n, _ = g.stats()
    var = torch.zeros_like(n).index_add_(0, g.index, centred * centred) / n
    return centred / (var.sqrt()[g.index] + eps)


@register(AdvantageEstimator.DR_GRPO)
def dr_grpo(g: Groups, eps: float, batch_moments: torch.Tensor | None = None) -> torch.Tensor:
    """r - group mean (Liu et al. 2025, Dr. GRPO: no std normalisation)."""
    return _centred(g)


@register(AdvantageEstimator.RLOO)
def rloo(g: Groups, eps: float, batch_moments: torch.Tensor | None = None) -> torch.Tensor:
    """r - mean of the other members of the group (Ahmadian et al. 2024); a group of one gets 0."""
    r, n, total = g.stats()
    nn = n[g.index]
    others = torch.where(nn > 1, (total[g.index] - r) / (nn - 1).clamp(min=1), r)
    return r - others


def moments(values: torch.Tensor) -> torch.Tensor:
    """(count, sum, sum of squares) of ``values`` in float64: what ranks all-reduce for a batch normalisation."""
    v = values.to(torch.float64)
    return torch.stack([torch.tensor(float(v.numel()), dtype=v.dtype, device=v.device), v.sum(), (v * v).sum()])


def _batch_normalise(values: torch.Tensor, eps: float, batch_moments: torch.Tensor | None) -> torch.Tensor:
    m = moments(values) if batch_moments is None else batch_moments.to(torch.float64)
    count = m[0].clamp(min=1.0)
    mean = m[1] / count
    var = (m[2] / count - mean * mean).clamp(min=0.0)
    return (values.to(torch.float64) - mean) / (var.sqrt() + eps)


def reinforce_pp_values(kind: AdvantageEstimator, g: Groups) -> torch.Tensor:
    """The values REINFORCE++ normalises over the batch: r itself, or r - group mean (with baseline)."""
    if kind is AdvantageEstimator.REINFORCE_PP:
        return g.rewards.to(torch.float64)
    return _centred(g)


@register(AdvantageEstimator.REINFORCE_PP)
def reinforce_pp(g: Groups, eps: float, batch_moments: torch.Tensor | None = None) -> torch.Tensor:
    """(r - batch mean) / (batch std + eps) (Hu 2025, REINFORCE++: global batch normalisation, no critic)."""
    return _batch_normalise(reinforce_pp_values(AdvantageEstimator.REINFORCE_PP, g), eps, batch_moments)


@register(AdvantageEstimator.REINFORCE_PP_BASELINE)
def reinforce_pp_baseline(g: Groups, eps: float, batch_moments: torch.Tensor | None = None) -> torch.Tensor:
    """a = r - group mean, then (a - batch mean of a) / (batch std of a + eps) (REINFORCE++-baseline)."""
    return _batch_normalise(reinforce_pp_values(AdvantageEstimator.REINFORCE_PP_BASELINE, g), eps, batch_moments)


def advantages(
    estimator: AdvantageEstimator,
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
    eps: float = 1e-6,
    batch_moments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-episode advantages of ``estimator`` (see :data:`ESTIMATORS`), in the rewards' dtype."""
    assert rewards.dim() == 1 and group_index.shape == rewards.shape, (rewards.shape, group_index.shape)
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator}")
    out = ESTIMATORS[estimator](Groups(rewards, group_index, num_groups), eps, batch_moments)
    return out.to(rewards.dtype)


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer_tokens: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), added to the reward of each episode.

    0 for ``len <= max - buffer``; ``factor * ((max - buffer) - len) / buffer`` inside the buffer (linear from 0
    to -factor); ``-factor`` beyond ``max``. ``buffer_tokens == 0`` turns it off (all zeros).
    """
    out = torch.zeros(lengths.shape, dtype=torch.float64, device=lengths.device)
    if buffer_tokens <= 0:
        return out
    length = lengths.to(torch.float64)
    start = max_tokens - buffer_tokens
    inside = (start - length) / buffer_tokens * factor
    out = torch.where(length > start, inside, out)
    return torch.where(length > max_tokens, torch.full_like(out, -factor), out)
