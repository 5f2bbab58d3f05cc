"""Mismatch masks, KL estimators and their combination in one micro-batch's loss, by hand."""

from __future__ import annotations

import math

import torch

from relayrl.config.loss import KlEstimator, KlUse, LossAggregation, LossConfig, MismatchMask, PolicyLoss
from relayrl.trainer.losses.kl import kl_estimate, kl_reward_penalty
from relayrl.trainer.losses.masks import MASKS, mismatch_mask
from relayrl.trainer.losses.step import loss_terms
from relayrl.trainer.losses.tokens import Tokens

ATOL = 1e-6  # float32 of logs and exps of simple fractions


def _tokens(ratios: list[float], seq: list[int], mask: list[float] | None = None) -> Tokens:
    """Tokens whose pi_prox / pi_behav are ``ratios`` (prox = 0, behaviour = -log ratio)."""
    n = len(ratios)
    return Tokens(
        torch.zeros(n, requires_grad=True),
        torch.zeros(n),
        -torch.tensor(ratios).log(),
        torch.ones(n),
        torch.tensor(mask) if mask is not None else torch.ones(n),
        torch.tensor(seq),
        max(seq) + 1,
    )


def test_every_mismatch_mask_of_the_config_enum_is_registered() -> None:
    assert set(MASKS) == set(MismatchMask)


def test_token_mask_drops_tokens_whose_ratio_leaves_the_bounds() -> None:
    t = _tokens([3.0, 1.5, 0.25, 1.0], [0, 0, 1, 1])

    kept = mismatch_mask(MismatchMask.TOKEN, t, 0.5, 2.0)

    assert kept.tolist() == [0.0, 1.0, 0.0, 1.0]


def test_sequence_mask_uses_the_product_and_geometric_mask_the_geometric_mean() -> None:
    # seq 0: 1.5 x 1.5 = 2.25 (product out, geometric mean 1.5 in); seq 1: 1.5 x 0.8 = 1.2 (both in);
    # seq 2: 3 x 3 (both out)
    t = _tokens([1.5, 1.5, 1.5, 0.8, 3.0, 3.0], [0, 0, 1, 1, 2, 2])

    assert mismatch_mask(MismatchMask.SEQUENCE, t, 0.5, 2.0).tolist() == [0, 0, 1, 1, 0, 0]
    assert mismatch_mask(MismatchMask.GEOMETRIC, t, 0.5, 2.0).tolist() == [1, 1, 1, 1, 0, 0]


def test_sequence_masks_ignore_positions_outside_the_loss_mask() -> None:
    t = _tokens([1.5, 100.0, 1.5], [0, 0, 0], mask=[1.0, 0.0, 1.0])  # the masked position's ratio is not counted

    assert mismatch_mask(MismatchMask.GEOMETRIC, t, 0.5, 2.0).tolist() == [1.0, 0.0, 1.0]
    assert mismatch_mask(MismatchMask.SEQUENCE, t, 0.5, 2.0).tolist() == [0.0, 0.0, 0.0]  # 2.25 > 2


def test_kl_estimators_match_hand_computed_values_and_gradients() -> None:
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])

    values = {k: float(kl_estimate(k, logp, ref).detach()) for k in KlEstimator}

    assert math.isclose(values[KlEstimator.K1], math.log(2), abs_tol=ATOL)
    assert math.isclose(values[KlEstimator.K2], 0.5 * math.log(2) ** 2, abs_tol=ATOL)
    assert math.isclose(values[KlEstimator.K3], 0.5 - 1 + math.log(2), abs_tol=ATOL)  # r = 0.5: r - 1 - log r
    kl_estimate(KlEstimator.K3, logp, ref).sum().backward()
    assert logp.grad is not None
    assert math.isclose(float(logp.grad[0]), 1 - 0.5, abs_tol=ATOL)  # d/dlogp (r - 1 - log r) = 1 - r


def test_kl_reward_penalty_sums_the_masked_tokens_of_each_sequence() -> None:
    behaviour = torch.log(torch.tensor([0.5, 0.5, 0.25, 0.5]))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.25, 0.25]))
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])

    penalty = kl_reward_penalty(KlEstimator.K1, 0.1, behaviour, ref, mask, torch.tensor([0, 0, 1, 1]), 2)

    # sequence 0: k1 = log 2 + 0; sequence 1: 0 (its second token is masked)
    torch.testing.assert_close(penalty, torch.tensor([0.1 * math.log(2), 0.0], dtype=torch.float64), rtol=0, atol=ATOL)


def test_loss_terms_mask_then_aggregate_per_sequence_and_add_the_kl_term() -> None:
    # seq 0: ratios 1, 4 (token 1 masked by IcePop); seq 1: one token ratio 1. advantages +1 everywhere.
    t = _tokens([1.0, 4.0, 1.0], [0, 0, 1])
    lc = LossConfig(
        policy_loss=PolicyLoss.TIS,
        importance_cap=10.0,
        mismatch_mask=MismatchMask.TOKEN,
        loss_aggregation=LossAggregation.SEQUENCE_MEAN,
        kl_coef=0.5,
        kl_estimator=KlEstimator.K1,
        kl_use=KlUse.LOSS,
    )
    ref = torch.tensor([0.0, 0.0, -1.0])  # k1 = logp - ref = 0, 0, 1

    terms = loss_terms(lc, t, ref)

    # token 0: -1 * 1 / |seq 0| (= 2, the unmasked length); token 2: (-1 + 0.5 * 1) / 1
    assert math.isclose(float(terms.loss_sum.detach()), -0.5 - 0.5, abs_tol=ATOL)
    assert float(terms.masked_tokens) == 1.0
    assert math.isclose(float(terms.ref_kl_sum), 1.0, abs_tol=ATOL)
