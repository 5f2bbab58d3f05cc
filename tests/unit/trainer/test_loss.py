"""Advantages, the loss of a micro-batch (relayrl.trainer.losses.step.loss_terms, as the learner computes it) and
token logprobs against hand-computed values."""

from __future__ import annotations

import math

import torch

from relayrl.config.loss import AdvantageEstimator, LossAggregation, LossConfig, PolicyLoss
from relayrl.trainer.learner import pack
from relayrl.trainer.logprobs import token_logprobs
from relayrl.trainer.losses.advantages import advantages
from relayrl.trainer.losses.step import LossTerms, loss_terms
from relayrl.trainer.losses.tokens import Tokens


def grpo_advantages(rewards: torch.Tensor, groups: torch.Tensor, num_groups: int, eps: float) -> torch.Tensor:
    return advantages(AdvantageEstimator.GRPO, rewards, groups, num_groups, eps)


def ppo_clip_loss(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_eps: float
) -> LossTerms:
    """PPO-clip against the behaviour logprobs ``old`` (rows ``[B, T]``, one advantage per row), summed over the
    masked tokens as the learner sums a micro-batch (token_mean: no per-token weight)."""
    lc = LossConfig(policy_loss=PolicyLoss.PPO_CLIP, clip_eps=clip_eps, loss_aggregation=LossAggregation.TOKEN_MEAN)
    return loss_terms(lc, Tokens.from_rows(logp, old.detach(), old, adv, mask))


def tis_loss(
    logp: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cap: float
) -> LossTerms:
    lc = LossConfig(policy_loss=PolicyLoss.TIS, importance_cap=cap, loss_aggregation=LossAggregation.TOKEN_MEAN)
    return loss_terms(lc, Tokens.from_rows(logp, prox, behav, adv, mask))


def test_grpo_advantages_two_groups_match_hand_computed_values() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])

    adv = grpo_advantages(rewards, groups, num_groups=2, eps=1e-6)

    # group 0: mean 0.5, population std 0.5 -> +-1 / (1 + 2e-6); group 1: zero variance -> 0
    expected = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0]) * (0.5 / (0.5 + 1e-6))
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)  # float32 of exact fractions


def test_grpo_advantages_unordered_groups_match_per_group_normalisation() -> None:
    rewards = torch.tensor([3.0, 1.0, 2.0, 5.0])
    groups = torch.tensor([1, 0, 1, 0])

    adv = grpo_advantages(rewards, groups, num_groups=2, eps=0.0)

    # group 0: (1, 5): mean 3, std 2 -> -1, +1; group 1: (3, 2): mean 2.5, std 0.5 -> +1, -1
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]), rtol=0, atol=1e-6)


def test_ppo_clip_loss_positive_and_negative_advantages_match_hand_computed_values() -> None:
    # token ratios: exp(0.5)=1.6487 (clipped at 1.2 for A>0), exp(-0.5)=0.6065 (clipped at 0.8 for A<0)
    logp = torch.tensor([[0.5, 0.0], [-0.5, 0.0]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])

    terms = ppo_clip_loss(logp, old, adv, mask, clip_eps=0.2)

    # row 0: tok0 -min(1.6487*2, 1.2*2) = -2.4; tok1 -min(2, 2) = -2
    # row 1: tok0 -min(0.6065*-1, 0.8*-1) = 0.8; tok1 masked out
    assert math.isclose(float(terms.loss_sum), -2.4 - 2.0 + 0.8, rel_tol=0, abs_tol=1e-6)
    assert float(terms.clipped_tokens) == 2.0
    expected_kl = (math.exp(0.5) - 1 - 0.5) + 0.0 + (math.exp(-0.5) - 1 + 0.5)
    assert math.isclose(float(terms.kl_sum), expected_kl, rel_tol=0, abs_tol=1e-6)


def test_ppo_clip_loss_gradient_vanishes_only_where_clipped() -> None:
    logp = torch.tensor([[0.5, 0.05]], requires_grad=True)
    terms = ppo_clip_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2)

    terms.loss_sum.backward()

    assert logp.grad is not None
    # clipped token: no gradient; unclipped: d(-ratio*A)/dlogp = -ratio = -exp(0.05)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -math.exp(0.05)]]), rtol=0, atol=1e-6)


def test_token_logprobs_with_temperature_equal_log_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    targets = torch.tensor([[0]])

    lp = token_logprobs(logits, targets, torch.tensor([0.5]))

    z = [4.0, 0.0, -2.0]
    expected = 4.0 - math.log(sum(math.exp(v) for v in z))
    assert math.isclose(float(lp), expected, rel_tol=0, abs_tol=1e-6)


def test_pack_aligns_completion_targets_and_mask() -> None:
    batch = pack(
        [[5, 6], [7]],
        [[8, 9], [10, 11, 12]],
        [[-0.1, -0.2], [-0.3, -0.4, -0.5]],
        None,
        [1.0, 1.0],
        pad_id=0,
        device=torch.device("cpu"),
    )

    # row 0: tokens 5 6 8 9 -> inputs 5 6 8, targets 6 8 9, completion targets at positions 1, 2
    assert batch.input_ids.tolist() == [[5, 6, 8], [7, 10, 11]]
    assert batch.targets.tolist() == [[6, 8, 9], [10, 11, 12]]
    assert batch.mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    torch.testing.assert_close(batch.behaviour_logprobs, torch.tensor([[0.0, -0.1, -0.2], [-0.3, -0.4, -0.5]]))


def test_dr_grpo_advantages_are_centred_but_not_scaled() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])

    adv = advantages(AdvantageEstimator.DR_GRPO, rewards, groups, num_groups=2)

    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]), rtol=0, atol=1e-7)


def test_rloo_advantages_use_the_mean_of_the_other_members() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 7.0])
    groups = torch.tensor([0, 0, 0, 1, 2])

    adv = advantages(AdvantageEstimator.RLOO, rewards, groups, num_groups=3)

    # group 0: 1 - (0+0)/2 = 1; 0 - (1+0)/2 = -0.5 (twice); groups of one have no baseline: 0
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0]), rtol=0, atol=1e-7)


def test_tis_loss_truncates_the_importance_weight_at_the_cap() -> None:
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    prox = logp.detach().clone()
    behav = torch.tensor([[-3.0, -1.5]])  # pi_prox / pi_behav = e^2 = 7.39 (capped at 2), e^0.5 = 1.65

    terms = tis_loss(logp, prox, behav, torch.tensor([1.0]), torch.ones(1, 2), cap=2.0)
    terms.loss_sum.backward()

    assert math.isclose(float(terms.loss_sum.detach()), -(2.0 + math.exp(0.5)), rel_tol=0, abs_tol=1e-5)
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -math.exp(0.5)]]), rtol=0, atol=1e-5)
