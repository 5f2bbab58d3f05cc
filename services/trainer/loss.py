"""Advantages, off-policy corrections and the token loss (pure tensor functions, unit-tested by hand).

Notation per completion token: logp = log pi_theta (with gradient), prox = log pi_prox (the trainer's own
weights before this update, recomputed by the trainer, no gradient), behav = log pi_behav (from inference,
the weights that generated the token). With one optimizer step per batch, prox equals logp numerically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relayrl.config.trainer import AdvantageEstimator


def _group_stats(rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r = rewards.to(torch.float64)
    count = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, group_index, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, group_index, r)
    return r, count, total


def advantages(estimator: AdvantageEstimator, rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int,
               eps: float = 1e-6) -> torch.Tensor:
    """Per-episode advantages, batched over groups. rewards [N], group_index [N] long in [0, num_groups)."""
    assert rewards.dim() == 1 and group_index.shape == rewards.shape, (rewards.shape, group_index.shape)
    r, count, total = _group_stats(rewards, group_index, num_groups)
    mean = (total / count)[group_index]
    if estimator is AdvantageEstimator.GRPO:
        centred = r - mean
        var = torch.zeros_like(count).index_add_(0, group_index, centred * centred) / count
        out = centred / (var.sqrt()[group_index] + eps)
    elif estimator is AdvantageEstimator.DR_GRPO:
        out = r - mean
    elif estimator is AdvantageEstimator.RLOO:
        n = count[group_index]
        others = torch.where(n > 1, (total[group_index] - r) / (n - 1).clamp(min=1), r)
        out = r - others  # a group of one has no baseline from others: advantage 0
    else:
        raise ValueError(f"unknown advantage estimator {estimator}")
    return out.to(rewards.dtype)


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int,
                    eps: float = 1e-6) -> torch.Tensor:
    return advantages(AdvantageEstimator.GRPO, rewards, group_index, num_groups, eps)


@dataclass
class LossTerms:
    """Loss summed over masked tokens (the caller divides by its normaliser) and diagnostic sums."""

    loss_sum: torch.Tensor
    clipped_tokens: torch.Tensor
    ratio_sum: torch.Tensor
    kl_sum: torch.Tensor


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_eps: float, weights: torch.Tensor | None = None) -> LossTerms:
    """Token-level PPO-clip: -w * min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), ratio = exp(logp - old).

    logprobs, old_logprobs, mask [B, T]; advantages [B]; weights [B, T] (detached importance weights, default
    1). Returns sums over masked tokens: the caller divides by one normaliser for the whole global batch.
    """
    assert logprobs.shape == old_logprobs.shape == mask.shape, (logprobs.shape, mask.shape)
    assert advantages.shape == logprobs.shape[:1], (advantages.shape, logprobs.shape)
    m = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1).to(logprobs.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach()
    with torch.no_grad():
        was_clipped = (clipped < unclipped).to(m.dtype) * m
        kl = (ratio - 1.0) - log_ratio  # k3 estimator of KL(old || current), >= 0
    return LossTerms(loss_sum=(per_token * m).sum(), clipped_tokens=was_clipped.sum(),
                     ratio_sum=(ratio.detach() * m).sum(), kl_sum=(kl * m).sum())


def tis_loss(logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
             advantages: torch.Tensor, mask: torch.Tensor, cap: float) -> LossTerms:
    """Truncated importance sampling policy gradient: -min(pi_prox / pi_behav, cap) * A * pi_theta / pi_prox.

    Its value is -w * A at pi_theta = pi_prox and its gradient -w * A * grad log pi_theta; no ratio clipping.
    """
    assert logprobs.shape == prox_logprobs.shape == behaviour_logprobs.shape == mask.shape
    m = mask.to(logprobs.dtype)
    w = torch.exp(prox_logprobs - behaviour_logprobs).clamp(max=cap).detach()
    ratio = torch.exp(logprobs - prox_logprobs.detach())
    per_token = -w * advantages.unsqueeze(1).to(logprobs.dtype) * ratio
    with torch.no_grad():
        log_ratio = logprobs - prox_logprobs
        kl = (ratio - 1.0) - log_ratio
    return LossTerms(loss_sum=(per_token * m).sum(), clipped_tokens=torch.zeros((), device=m.device),
                     ratio_sum=(ratio.detach() * m).sum(), kl_sum=(kl * m).sum())


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at targets. logits [B, T, V], targets [B, T], temperature [B]."""
    assert logits.shape[:2] == targets.shape and temperature.shape == logits.shape[:1]
    scaled = logits.float() / temperature.view(-1, 1, 1)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
