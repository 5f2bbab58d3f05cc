"""Advantages, off-policy corrections and the token loss: the entry points kept from before the registries.

The algorithms live in :mod:`relayrl.trainer.losses` (registries chosen by config enums); this module keeps the
row-shaped functions (``[B, T]`` tensors, one advantage per row) that callers and tests use, built on them.
Notation per completion token: logp = log pi_theta (with gradient), prox = log pi_prox (the trainer's own
weights before this update, recomputed by the trainer, no gradient), behav = log pi_behav (from inference,
the weights that generated the token). With one optimizer step per batch, prox equals logp numerically.
"""

from __future__ import annotations

import torch

from relayrl.config.loss import AdvantageEstimator, PolicyLoss
from relayrl.trainer.losses.advantages import advantages
from relayrl.trainer.losses.policy import PolicyParams, policy_loss
from relayrl.trainer.losses.step import LossTerms
from relayrl.trainer.losses.tokens import Tokens

__all__ = ["LossTerms", "advantages", "grpo_advantages", "ppo_clip_loss", "tis_loss", "token_logprobs"]


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int,
                    eps: float = 1e-6) -> torch.Tensor:
    return advantages(AdvantageEstimator.GRPO, rewards, group_index, num_groups, eps)


def _row_terms(kind: PolicyLoss, t: Tokens, p: PolicyParams, weights: torch.Tensor | None = None) -> LossTerms:
    terms = policy_loss(kind, t, p)
    per_token = terms.per_token if weights is None else terms.per_token * weights.detach().reshape(-1)
    with torch.no_grad():
        kl = (terms.ratio - 1.0) - torch.log(terms.ratio.clamp(min=1e-30))  # k3 estimator of KL(old || current), >= 0
    return LossTerms(loss_sum=(per_token * t.mask).sum(), clipped_tokens=(terms.clipped * t.mask).sum(),
                     ratio_sum=(terms.ratio * t.mask).sum(), kl_sum=(kl * t.mask).sum())


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_eps: float, weights: torch.Tensor | None = None) -> LossTerms:
    """Token-level PPO-clip: -w * min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), ratio = exp(logp - old).

    logprobs, old_logprobs, mask [B, T]; advantages [B]; weights [B, T] (detached importance weights, default
    1). Returns sums over masked tokens: the caller divides by one normaliser for the whole global batch.
    """
    t = Tokens.from_rows(logprobs, old_logprobs.detach(), old_logprobs, advantages, mask)
    return _row_terms(PolicyLoss.PPO_CLIP, t, PolicyParams(clip_eps, clip_eps), weights)


def tis_loss(logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
             advantages: torch.Tensor, mask: torch.Tensor, cap: float) -> LossTerms:
    """Truncated importance sampling policy gradient: -min(pi_prox / pi_behav, cap) * A * pi_theta / pi_prox.

    Its value is -w * A at pi_theta = pi_prox and its gradient -w * A * grad log pi_theta; no ratio clipping.
    """
    t = Tokens.from_rows(logprobs, prox_logprobs, behaviour_logprobs, advantages, mask)
    return _row_terms(PolicyLoss.TIS, t, PolicyParams(importance_cap=cap))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at targets. logits [B, T, V], targets [B, T], temperature
    [B] (one per row) or [B, T] (one per position, for packed rows)."""
    assert logits.shape[:2] == targets.shape
    assert temperature.shape in (logits.shape[:1], logits.shape[:2]), (temperature.shape, logits.shape)
    scale = temperature.view(-1, 1, 1) if temperature.dim() == 1 else temperature.unsqueeze(-1)
    scaled = logits.float() / scale
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
