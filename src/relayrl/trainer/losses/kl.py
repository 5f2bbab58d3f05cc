"""KL estimators against a frozen reference policy (Schulman 2020, "Approximating KL divergence").

Per token, with log r = log pi_ref - log pi_theta for a token sampled from pi_theta:
k1 = -log r (unbiased, can be negative), k2 = (log r)^2 / 2 (biased, low variance), k3 = (r - 1) - log r
(unbiased, always >= 0). Used as a loss term (gradient through log pi_theta) or, detached and summed over a
sequence, as a penalty on its reward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from relayrl.config.loss import KlEstimator

KlFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_r = ref_logp - logp
    return torch.exp(log_r) - 1.0 - log_r


KL_ESTIMATORS: dict[KlEstimator, KlFn] = {KlEstimator.K1: k1, KlEstimator.K2: k2, KlEstimator.K3: k3}


def kl_estimate(kind: KlEstimator, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) by ``kind``; ``ref_logp`` carries no gradient."""
    return KL_ESTIMATORS[kind](logp, ref_logp.detach())


def kl_reward_penalty(
    kind: KlEstimator,
    coef: float,
    behaviour: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    seq: torch.Tensor,
    num_seqs: int,
) -> torch.Tensor:
    """Per-sequence penalty ``coef * sum_t k(behav, ref)`` (detached, float64 ``[num_seqs]``) over flat tokens
    with their sequence index ``seq``, to subtract from the rewards before advantages (the sampled tokens' own
    logprobs stand for pi_theta)."""
    k = KL_ESTIMATORS[kind](behaviour.detach().to(torch.float64), ref_logp.detach().to(torch.float64))
    out = torch.zeros(num_seqs, dtype=torch.float64, device=k.device)
    return coef * out.index_add_(0, seq, k * mask.to(k.dtype))
