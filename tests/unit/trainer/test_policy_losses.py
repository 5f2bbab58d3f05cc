"""Policy losses of the registry (values and gradients) against hand-computed values."""

from __future__ import annotations

import math

import torch

from relayrl.config.loss import LossAggregation, PolicyLoss
from relayrl.trainer.losses.policy import POLICY_LOSSES, PolicyParams, policy_loss
from relayrl.trainer.losses.tokens import Tokens, aggregation_weights

# float32 values of exp() and products of exact fractions: 1e-6 absolute covers their rounding
ATOL = 1e-6


def _tokens(
    logp: list[float], behaviour: list[float], adv: list[float], seq: list[int], prox: list[float] | None = None
) -> Tokens:
    lp = torch.tensor(logp, requires_grad=True)
    return Tokens(
        lp,
        torch.tensor(prox) if prox is not None else lp.detach(),
        torch.tensor(behaviour),
        torch.tensor(adv),
        torch.ones(len(logp)),
        torch.tensor(seq),
        max(seq) + 1,
    )


def _grad(t: Tokens, loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    assert t.logp.grad is not None
    return t.logp.grad


def test_every_policy_loss_of_the_config_enum_is_registered() -> None:
    assert set(POLICY_LOSSES) == set(PolicyLoss)


def test_ppo_clip_with_clip_higher_clips_asymmetrically() -> None:
    # ratios exp(0.5) = 1.6487 (A = +1), exp(-0.5) = 0.6065 (A = -1 and A = +1)
    t = _tokens([0.5, -0.5, -0.5], [0.0, 0.0, 0.0], [1.0, -1.0, 1.0], [0, 1, 2])

    terms = policy_loss(PolicyLoss.PPO_CLIP, t, PolicyParams(clip_low=0.2, clip_high=0.28))

    # -min(1.6487, 1.28) = -1.28 (clipped high); -min(-0.6065, -0.8) = 0.8 (clipped low); -min(0.6065, 0.8)
    torch.testing.assert_close(terms.per_token, torch.tensor([-1.28, 0.8, -math.exp(-0.5)]), rtol=0, atol=ATOL)
    assert terms.clipped.tolist() == [1.0, 1.0, 0.0]
    grad = _grad(t, terms.per_token.sum())
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -math.exp(-0.5)]), rtol=0, atol=ATOL)


def test_decoupled_ppo_weights_by_the_capped_proximal_over_behaviour_ratio() -> None:
    t = _tokens([0.0, 0.0], [-math.log(1.5), -math.log(3.0)], [2.0, 2.0], [0, 0], prox=[0.0, 0.0])

    terms = policy_loss(PolicyLoss.DECOUPLED_PPO, t, PolicyParams(importance_cap=2.0))

    # ratio to prox is 1 (not clipped); weights 1.5 and min(3, 2) = 2; loss -w * A
    torch.testing.assert_close(terms.per_token, torch.tensor([-3.0, -4.0]), rtol=0, atol=ATOL)


def test_tis_weights_the_policy_gradient_by_the_truncated_ratio() -> None:
    t = _tokens([0.0, 0.0], [-1.0, -0.1], [1.0, -1.0], [0, 1], prox=[0.0, 0.0])

    terms = policy_loss(PolicyLoss.TIS, t, PolicyParams(importance_cap=2.0))

    w = [2.0, math.exp(0.1)]  # min(e, 2), exp(0.1)
    torch.testing.assert_close(terms.per_token, torch.tensor([-w[0], w[1]]), rtol=0, atol=ATOL)
    torch.testing.assert_close(_grad(t, terms.per_token.sum()), torch.tensor([-w[0], w[1]]), rtol=0, atol=ATOL)
    assert terms.clipped.tolist() == [1.0, 0.0]


def test_gspo_clips_the_length_normalised_sequence_ratio() -> None:
    # sequence 0: log ratios 0.2, 0.4 -> s = exp(0.3) = 1.3499 > 1.2, A = +1: clipped, no gradient
    # sequence 1: log ratios -0.1, 0.1 -> s = 1, A = -2: loss 2 per token
    t = _tokens([0.2, 0.4, -0.1, 0.1], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, -2.0, -2.0], [0, 0, 1, 1])

    terms = policy_loss(PolicyLoss.GSPO, t, PolicyParams(clip_low=0.2, clip_high=0.2))

    torch.testing.assert_close(terms.per_token, torch.tensor([-1.2, -1.2, 2.0, 2.0]), rtol=0, atol=ATOL)
    torch.testing.assert_close(terms.ratio, torch.tensor([math.exp(0.3)] * 2 + [1.0, 1.0]), rtol=0, atol=ATOL)
    weights = aggregation_weights(LossAggregation.SEQUENCE_MEAN, t)
    grad = _grad(t, (terms.per_token * weights).sum())
    # sequence form: d(-s A)/d logp_t = -A s / |y| = 2 * 1 / 2 = 1 for sequence 1
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, 1.0, 1.0]), rtol=0, atol=ATOL)


def test_cispo_clips_the_weight_and_keeps_every_token_gradient() -> None:
    t = _tokens([0.5, -0.5, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0, 0, 0])

    terms = policy_loss(PolicyLoss.CISPO, t, PolicyParams(clip_low=0.2, clip_high=0.28))

    w = torch.tensor([1.28, 0.8, 1.0])  # clip(1.6487), clip(0.6065), 1
    torch.testing.assert_close(terms.per_token, -w, rtol=0, atol=ATOL)
    assert terms.clipped.tolist() == [1.0, 1.0, 0.0]
    # unlike PPO-clip, the clipped tokens still get gradient -w * A
    torch.testing.assert_close(_grad(t, terms.per_token.sum()), -w, rtol=0, atol=ATOL)


def test_sequence_mean_weights_each_token_by_its_sequence_length() -> None:
    t = _tokens([0.0] * 5, [0.0] * 5, [1.0] * 5, [0, 0, 1, 1, 1])

    weights = aggregation_weights(LossAggregation.SEQUENCE_MEAN, t)

    torch.testing.assert_close(weights, torch.tensor([0.5, 0.5, 1 / 3, 1 / 3, 1 / 3]), rtol=0, atol=ATOL)
    assert aggregation_weights(LossAggregation.TOKEN_MEAN, t).tolist() == [1.0] * 5
