"""Advantages and the PPO-clip token loss (pure tensor functions, unit-tested against hand values)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int,
                    eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of its group) / (population std of its group + eps), batched over groups.

    rewards [N] float, group_index [N] long in [0, num_groups). A group whose rewards are all equal gets
    advantage 0 for every member (it carries no learning signal).
    """
    assert rewards.dim() == 1 and group_index.shape == rewards.shape, (rewards.shape, group_index.shape)
    r = rewards.to(torch.float64)
    ones = torch.ones_like(r)
    count = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, group_index, ones)
    total = torch.zeros_like(count).index_add_(0, group_index, r)
    mean = total / count
    centred = r - mean[group_index]
    var = torch.zeros_like(count).index_add_(0, group_index, centred * centred) / count
    std = var.sqrt()
    return (centred / (std[group_index] + eps)).to(rewards.dtype)


@dataclass
class LossTerms:
    """Loss summed over tokens (divide by the global token count yourself) and diagnostics sums."""

    loss_sum: torch.Tensor
    clipped_tokens: torch.Tensor
    ratio_sum: torch.Tensor
    kl_sum: torch.Tensor


def ppo_clip_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_eps: float) -> LossTerms:
    """Token-level PPO-clip objective against the behaviour policy's logprobs.

    logprobs, behaviour_logprobs, mask [B, T]; advantages [B] (broadcast over tokens).
    Per token: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), with ratio = exp(logp - logp_behaviour).
    Returns sums over masked tokens, so that the caller normalises by the token count of the whole global
    batch (token-mean): every token of the batch weighs the same, whatever micro-batch it is in.
    """
    assert logprobs.shape == behaviour_logprobs.shape == mask.shape, (logprobs.shape, mask.shape)
    assert advantages.shape == logprobs.shape[:1], (advantages.shape, logprobs.shape)
    m = mask.to(logprobs.dtype)
    log_ratio = logprobs - behaviour_logprobs
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1).to(logprobs.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        was_clipped = (clipped < unclipped).to(m.dtype) * m
        kl = (ratio - 1.0) - log_ratio  # k3 estimator of KL(behaviour || current), >= 0
    return LossTerms(
        loss_sum=(per_token * m).sum(),
        clipped_tokens=was_clipped.sum(),
        ratio_sum=(ratio.detach() * m).sum(),
        kl_sum=(kl * m).sum(),
    )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at targets. logits [B, T, V], targets [B, T], temperature [B]."""
    assert logits.shape[:2] == targets.shape and temperature.shape == logits.shape[:1]
    scaled = logits.float() / temperature.view(-1, 1, 1)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
