"""One micro-batch's loss under the configured algorithms: mismatch mask, policy loss, KL term, aggregation.

The result is a sum over the micro-batch's tokens that the caller divides by one global normaliser (see
:func:`denominator`), so 1 rank and N ranks, and any micro-batch split, give the same gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from relayrl.config.loss import KlUse, LossAggregation, LossConfig
from relayrl.trainer.losses.kl import kl_estimate
from relayrl.trainer.losses.masks import mismatch_mask
from relayrl.trainer.losses.policy import PolicyParams, policy_loss
from relayrl.trainer.losses.tokens import Tokens, aggregation_weights


def _zero() -> torch.Tensor:
    return torch.zeros(())


@dataclass
class LossTerms:
    """Loss summed over masked tokens (the caller divides by its normaliser) and diagnostic sums."""

    loss_sum: torch.Tensor
    clipped_tokens: torch.Tensor
    ratio_sum: torch.Tensor
    kl_sum: torch.Tensor  # k3 of the loss's ratio: KL(old || current) >= 0
    masked_tokens: torch.Tensor = field(default_factory=_zero)  # tokens the mismatch mask left out
    ref_kl_sum: torch.Tensor = field(default_factory=_zero)  # the KL estimate against the reference
    teacher_kl_sum: torch.Tensor = field(default_factory=_zero)  # log pi - log pi_teacher (reverse KL sample)


def policy_params(lc: LossConfig) -> PolicyParams:
    return PolicyParams(
        clip_low=lc.clip_eps, clip_high=lc.clip_high(), importance_cap=lc.importance_cap, distill_coef=lc.distill_coef
    )


def denominator(lc: LossConfig, global_tokens: float, global_episodes: float, max_completion_tokens: int) -> float:
    """The one normaliser of the global batch's summed token losses, by ``loss_aggregation``."""
    if lc.loss_aggregation is LossAggregation.TOKEN_MEAN:
        return max(global_tokens, 1.0)
    if lc.loss_aggregation is LossAggregation.SEQUENCE_MEAN:
        return max(global_episodes, 1.0)
    return max(global_episodes * max_completion_tokens, 1.0)


def loss_terms(lc: LossConfig, t: Tokens, ref_logp: torch.Tensor | None = None) -> LossTerms:
    """Sums over ``t``'s tokens: the masked, aggregated loss and diagnostics (``ref_logp`` flat like ``t``)."""
    kept = mismatch_mask(lc.mismatch_mask, t, lc.mismatch_low, lc.mismatch_high)
    masked_view = t.with_mask(kept)
    terms = policy_loss(lc.effective_policy_loss(), masked_view, policy_params(lc))
    per_token = terms.per_token
    ref_kl = torch.zeros((), dtype=t.logp.dtype, device=t.logp.device)
    if ref_logp is not None:
        k = kl_estimate(lc.kl_estimator, t.logp, ref_logp)
        ref_kl = (k.detach() * t.mask).sum()
        if lc.kl_use is KlUse.LOSS and lc.kl_coef > 0:
            per_token = per_token + lc.kl_coef * k
    weights = aggregation_weights(lc.loss_aggregation, t)  # lengths of the unmasked sequences
    with torch.no_grad():
        log_ratio = torch.log(terms.ratio.clamp(min=1e-30))
        kl = (terms.ratio - 1.0) - log_ratio
    return LossTerms(
        loss_sum=(per_token * weights * kept).sum(),
        clipped_tokens=(terms.clipped * kept).sum(),
        ratio_sum=(terms.ratio * t.mask).sum(),
        kl_sum=(kl * t.mask).sum(),
        masked_tokens=(t.mask - kept).sum().detach(),
        ref_kl_sum=ref_kl,
        teacher_kl_sum=((t.prox - t.teacher).detach() * t.mask).sum()
        if t.teacher is not None
        else torch.zeros((), dtype=t.logp.dtype, device=t.logp.device),
    )
