"""On-policy distillation's loss (policy_loss reverse_kl) against hand-computed values, and its expected gradient
against autograd of the exact reverse KL."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.common.config import ConfigError
from relayrl.config import load_run_config
from relayrl.config.trainer import LossConfig, PolicyLoss
from relayrl.trainer.losses.policy import PolicyParams, policy_loss
from relayrl.trainer.losses.step import loss_terms
from relayrl.trainer.losses.tokens import Tokens

# float32 sums and products of a few exact values: 1e-6 absolute covers their rounding
ATOL = 1e-6


def _tokens(logp: list[float], behaviour: list[float], adv: list[float], teacher: list[float] | None) -> Tokens:
    lp = torch.tensor(logp, requires_grad=True)
    n = len(logp)
    return Tokens(lp, lp.detach(), torch.tensor(behaviour), torch.tensor(adv), torch.ones(n), torch.arange(n), n,
                  None if teacher is None else torch.tensor(teacher))


def test_reverse_kl_penalises_each_token_by_its_student_minus_teacher_logprob() -> None:
    # on-policy (behaviour = current): ratio 1; advantages -(logp - teacher) = -0.5, +1.0, 0.0
    t = _tokens([-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], [0.0, 0.0, 0.0], [-1.5, -1.0, -0.5])

    terms = policy_loss(PolicyLoss.REVERSE_KL, t, PolicyParams())

    torch.testing.assert_close(terms.per_token, torch.tensor([0.5, -1.0, 0.0]), rtol=0, atol=ATOL)
    terms.per_token.sum().backward()
    assert t.logp.grad is not None
    # d(-ratio * A)/d logp = -A: lower the student's logprob where it exceeds the teacher's, raise it otherwise
    torch.testing.assert_close(t.logp.grad, torch.tensor([0.5, -1.0, 0.0]), rtol=0, atol=ATOL)


def test_reverse_kl_adds_the_reward_advantage_and_scales_the_penalty_by_its_coefficient() -> None:
    t = _tokens([-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0], [-1.5, -1.0])

    terms = policy_loss(PolicyLoss.REVERSE_KL, t, PolicyParams(distill_coef=0.5))

    # A_t = A - 0.5 (logp - teacher): 1 - 0.25 = 0.75; -1 + 0.5 = -0.5; loss -A_t
    torch.testing.assert_close(terms.per_token, torch.tensor([-0.75, 0.5]), rtol=0, atol=ATOL)


def test_reverse_kl_clips_the_behaviour_ratio_like_ppo() -> None:
    # ratio exp(0.5) = 1.6487 with a positive advantage (teacher above student by 1): clipped at 1.2
    t = _tokens([-1.0], [-1.5], [0.0], [0.0])

    terms = policy_loss(PolicyLoss.REVERSE_KL, t, PolicyParams(clip_low=0.2, clip_high=0.2))

    torch.testing.assert_close(terms.per_token, torch.tensor([-1.2]), rtol=0, atol=ATOL)
    assert terms.clipped.tolist() == [1.0]
    torch.testing.assert_close(terms.ratio, torch.tensor([math.exp(0.5)]), rtol=0, atol=ATOL)


def test_reverse_kl_expected_gradient_is_the_gradient_of_the_exact_reverse_kl() -> None:
    # one token over a vocabulary of 5: weighting each token's loss by pi(a) (the on-policy expectation) gives
    # grad KL(pi || q) = grad sum_a pi(a) (log pi(a) - log q(a)), computed exactly by autograd
    theta = torch.tensor([0.3, -1.0, 0.8, 0.0, 0.5], dtype=torch.float64, requires_grad=True)
    log_q = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 0.4, 0.0], dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    f64 = torch.float64
    t = Tokens(logp, logp.detach(), logp.detach(), torch.zeros(5, dtype=f64), torch.ones(5, dtype=f64),
               torch.arange(5), 5, log_q)

    terms = policy_loss(PolicyLoss.REVERSE_KL, t, PolicyParams())
    (terms.per_token * logp.detach().exp()).sum().backward()
    ours = theta.grad.clone()  # type: ignore[union-attr]
    theta.grad = None
    logp2 = torch.log_softmax(theta, 0)
    (logp2.exp() * (logp2 - log_q)).sum().backward()

    # float64 throughout: the two are the same sum in a different order
    torch.testing.assert_close(ours, theta.grad, rtol=0, atol=1e-12)


def test_reverse_kl_without_the_teachers_logprobs_is_an_error() -> None:
    t = _tokens([-1.0], [-1.0], [0.0], None)

    with pytest.raises(ValueError, match="teacher"):
        policy_loss(PolicyLoss.REVERSE_KL, t, PolicyParams())


def test_loss_terms_report_the_summed_teacher_kl_sample() -> None:
    t = _tokens([-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], [0.0, 0.0, 0.0], [-1.5, -1.0, -0.5])

    terms = loss_terms(LossConfig(policy_loss=PolicyLoss.REVERSE_KL), t)

    torch.testing.assert_close(terms.teacher_kl_sum, torch.tensor(0.5 - 1.0 + 0.0), rtol=0, atol=ATOL)
    torch.testing.assert_close(terms.loss_sum, torch.tensor(0.5 - 1.0), rtol=0, atol=ATOL)


@pytest.mark.parametrize("overrides", [["trainer.loss.policy_loss=reverse_kl"],
                                       ["trainer.teacher.address=127.0.0.1:1"]])
def test_a_teacher_and_the_reverse_kl_loss_are_configured_together_or_not_at_all(overrides: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"teacher\.address"):
        load_run_config(None, overrides)
