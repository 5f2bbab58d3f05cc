"""Policy losses: a registry of pure functions chosen by ``trainer.loss.policy_loss``.

Each maps a :class:`~relayrl.trainer.losses.tokens.Tokens` view and :class:`PolicyParams` to per-token losses
(with gradient) and detached diagnostics; aggregation and the global normaliser are the caller's. With one
optimizer step per batch ``prox`` equals ``logp`` numerically, so the ratio against ``prox`` is 1 and the ratio
that moves is the one against the behaviour policy. Formulas and papers: docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from relayrl.config.loss import PolicyLoss
from relayrl.trainer.losses.tokens import Tokens


@dataclass(frozen=True)
class PolicyParams:
    clip_low: float = 0.2  # ratio lower bound 1 - clip_low
    clip_high: float = 0.2  # ratio upper bound 1 + clip_high (DAPO's clip-higher: > clip_low)
    importance_cap: float = 2.0  # cap of pi_prox / pi_behav (tis; decoupled_ppo when > 0)
    distill_coef: float = 1.0  # weight of the reverse-KL sample in reverse_kl's per-token advantage


@dataclass
class PolicyTerms:
    per_token: torch.Tensor  # [N] loss per token (with gradient), not yet masked or aggregated
    clipped: torch.Tensor  # [N] 1 where the clip (or cap) took effect, detached
    ratio: torch.Tensor  # [N] the importance ratio the loss used, detached


PolicyFn = Callable[[Tokens, PolicyParams], PolicyTerms]
POLICY_LOSSES: dict[PolicyLoss, PolicyFn] = {}


def register(kind: PolicyLoss) -> Callable[[PolicyFn], PolicyFn]:
    def wrap(fn: PolicyFn) -> PolicyFn:
        POLICY_LOSSES[kind] = fn
        return fn

    return wrap


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, p: PolicyParams) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(ratio * A, clip(ratio, 1 - low, 1 + high) * A) and where the clipped branch was taken."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - p.clip_low, 1.0 + p.clip_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach().to(ratio.dtype)


def _straight_through(logp: torch.Tensor) -> torch.Tensor:
    """exp(logp - sg(logp)): value 1, gradient grad log pi."""
    return torch.exp(logp - logp.detach())


@register(PolicyLoss.PPO_CLIP)
def ppo_clip(t: Tokens, p: PolicyParams) -> PolicyTerms:
    """PPO-clip against the behaviour logprobs (Schulman et al. 2017); clip_high > clip_low is DAPO's
    clip-higher (Yu et al. 2025)."""
    ratio = torch.exp(t.logp - t.behaviour)
    loss, was_clipped = _clipped_objective(ratio, t.advantages, p)
    return PolicyTerms(loss, was_clipped, ratio.detach())


@register(PolicyLoss.DECOUPLED_PPO)
def decoupled_ppo(t: Tokens, p: PolicyParams) -> PolicyTerms:
    """PPO-clip against the proximal policy, times w = pi_prox / pi_behav, capped when importance_cap > 0
    (Hilton et al. 2022; AReaL, Fu et al. 2025)."""
    ratio = torch.exp(t.logp - t.prox.detach())
    loss, was_clipped = _clipped_objective(ratio, t.advantages, p)
    w = torch.exp(t.prox - t.behaviour).detach()
    if p.importance_cap > 0:
        w = w.clamp(max=p.importance_cap)
    return PolicyTerms(loss * w, was_clipped, ratio.detach())


@register(PolicyLoss.TIS)
def tis(t: Tokens, p: PolicyParams) -> PolicyTerms:
    """-min(pi_prox / pi_behav, cap) * A * pi_theta / pi_prox: truncated importance sampling, no ratio clip."""
    raw = torch.exp(t.prox - t.behaviour).detach()
    w = raw.clamp(max=p.importance_cap)
    ratio = torch.exp(t.logp - t.prox.detach())
    return PolicyTerms(-w * t.advantages * ratio, (raw > p.importance_cap).to(raw.dtype), ratio.detach())


@register(PolicyLoss.GSPO)
def gspo(t: Tokens, p: PolicyParams) -> PolicyTerms:
    """GSPO (Zheng et al. 2025): the sequence ratio s_i = exp(mean_t (logp - behav)) clipped per sequence,
    in its token form s_i,t = sg(s_i) * pi_theta / sg(pi_theta) (same value and, under sequence_mean
    aggregation, the same gradient as the sequence form)."""
    log_s = t.seq_sum(t.logp - t.behaviour) / t.seq_lengths()
    s_tok = torch.exp(log_s.detach()[t.seq]) * _straight_through(t.logp)
    loss, was_clipped = _clipped_objective(s_tok, t.advantages, p)
    return PolicyTerms(loss, was_clipped, s_tok.detach())


@register(PolicyLoss.CISPO)
def cispo(t: Tokens, p: PolicyParams) -> PolicyTerms:
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1 - low, 1 + high)) * A * log pi_theta, r = pi_theta / pi_behav;
    every token keeps a gradient (the weight is clipped, never the token)."""
    raw = torch.exp(t.logp - t.behaviour).detach()
    w = raw.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)
    was_clipped = (w != raw).to(raw.dtype)
    return PolicyTerms(-w * t.advantages * _straight_through(t.logp), was_clipped, raw)


@register(PolicyLoss.REVERSE_KL)
def reverse_kl(t: Tokens, p: PolicyParams) -> PolicyTerms:
    """On-policy distillation (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025): the student's sampled tokens
    scored by the teacher; each token's advantage is A - coef * (log pi_behav - log pi_teacher - b), the per-token
    sample of the reverse KL as a penalty, minus its baseline b (relayrl.trainer.losses.distill; 0 when None), in
    the PPO-clip objective against the behaviour logprobs. The sample uses the sampler's logprobs, as Thinking
    Machines' form does. On-policy its expected gradient is coef * E_pi[(log pi - log pi_T) grad log pi] =
    coef * grad KL(pi || pi_T) (plus the RL term): b does not depend on the token (up to its own share of a group
    mean), so it changes the variance, not the expectation."""
    if t.teacher is None:
        raise ValueError("reverse_kl needs the teacher's logprobs (trainer.teacher)")
    sample = t.behaviour - t.teacher
    if t.distill_baseline is not None:
        sample = sample - t.distill_baseline
    adv = t.advantages - p.distill_coef * sample.detach()
    ratio = torch.exp(t.logp - t.behaviour)
    loss, was_clipped = _clipped_objective(ratio, adv, p)
    return PolicyTerms(loss, was_clipped, ratio.detach())


def policy_loss(kind: PolicyLoss, t: Tokens, p: PolicyParams) -> PolicyTerms:
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind}")
    return POLICY_LOSSES[kind](t, p)
