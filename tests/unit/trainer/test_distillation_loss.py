"""On-policy distillation's loss (policy_loss reverse_kl) against hand-computed values, and its expected gradient
against autograd of the exact reverse KL."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relayrl.common.model import load_model
from relayrl.config import load_run_config
from relayrl.config.loss import DistillBaseline, LossConfig, PolicyLoss
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import TrainerConfig
from relayrl.config.typed import ConfigError
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner
from relayrl.trainer.losses.distill import distill_baselines
from relayrl.trainer.losses.policy import PolicyParams, policy_loss
from relayrl.trainer.losses.step import loss_terms
from relayrl.trainer.losses.tokens import Tokens
from tests.unit.trainer.test_learner import _episodes

# float32 sums and products of a few exact values: 1e-6 absolute covers their rounding
ATOL = 1e-6


def _tokens(logp: list[float], behaviour: list[float], adv: list[float], teacher: list[float] | None) -> Tokens:
    lp = torch.tensor(logp, requires_grad=True)
    n = len(logp)
    return Tokens(
        lp,
        lp.detach(),
        torch.tensor(behaviour),
        torch.tensor(adv),
        torch.ones(n),
        torch.arange(n),
        n,
        None if teacher is None else torch.tensor(teacher),
    )


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
    # ratio exp(0.5) = 1.6487; advantage -(behaviour - teacher) = 1.5 (the sampler's logprob, as Thinking Machines'
    # form): clipped at 1.2, loss -1.2 * 1.5
    t = _tokens([-1.0], [-1.5], [0.0], [0.0])

    terms = policy_loss(PolicyLoss.REVERSE_KL, t, PolicyParams(clip_low=0.2, clip_high=0.2))

    torch.testing.assert_close(terms.per_token, torch.tensor([-1.8]), rtol=0, atol=ATOL)
    assert terms.clipped.tolist() == [1.0]
    torch.testing.assert_close(terms.ratio, torch.tensor([math.exp(0.5)]), rtol=0, atol=ATOL)


def test_reverse_kl_subtracts_the_baseline_from_each_tokens_sample() -> None:
    # samples behaviour - teacher = 0.5, -1.0; minus baselines 0.25, 0.5 = 0.25, -1.5; advantages 2 x -0.25 + 1 and
    # 2 x 1.5 + 0 (distill_coef 2, reward advantages 1 and 0); on-policy the loss is -A
    t = replace(
        _tokens([-1.0, -2.0], [-1.0, -2.0], [1.0, 0.0], [-1.5, -1.0]), distill_baseline=torch.tensor([0.25, 0.5])
    )

    terms = policy_loss(PolicyLoss.REVERSE_KL, t, PolicyParams(distill_coef=2.0))

    torch.testing.assert_close(terms.per_token, torch.tensor([-0.5, -3.0]), rtol=0, atol=ATOL)


def test_group_baselines_are_the_mean_sample_of_the_groups_trained_tokens_at_each_position() -> None:
    # flat tokens of four episodes: completion positions 0,1 | 0 | 0,1,2 | 0,1 in groups a, a, b, a
    samples = torch.tensor([1.0, 3.0, 3.0, 5.0, 7.0, 9.0, 2.0, 4.0])
    group = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0])
    position = torch.tensor([0, 1, 0, 0, 1, 2, 0, 1])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0])

    grouped = distill_baselines(DistillBaseline.GROUP, samples, group, position, mask)
    none = distill_baselines(DistillBaseline.NONE, samples, group, position, mask)

    # a, position 0: (1 + 3 + 2) / 3; a, position 1: 3 alone (episode 3's token there is out of the loss: 0);
    # b: each trained token alone, its masked one 0. Small exact sums: compared exactly
    assert grouped.tolist() == [2.0, 3.0, 2.0, 5.0, 0.0, 9.0, 2.0, 0.0]
    assert none.tolist() == [0.0] * 8


@pytest.mark.parametrize("baseline", [0.0, 3.0])
def test_reverse_kl_expected_gradient_is_the_gradient_of_the_exact_reverse_kl(baseline: float) -> None:
    # one token over a vocabulary of 5: weighting each token's loss by pi(a) (the on-policy expectation) gives
    # grad KL(pi || q) = grad sum_a pi(a) (log pi(a) - log q(a)), computed exactly by autograd; a baseline the
    # same for every token changes nothing in expectation (sum_a pi(a) grad log pi(a) = 0)
    theta = torch.tensor([0.3, -1.0, 0.8, 0.0, 0.5], dtype=torch.float64, requires_grad=True)
    log_q = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 0.4, 0.0], dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    f64 = torch.float64
    t = Tokens(
        logp,
        logp.detach(),
        logp.detach(),
        torch.zeros(5, dtype=f64),
        torch.ones(5, dtype=f64),
        torch.arange(5),
        5,
        log_q,
        torch.full((5,), baseline, dtype=f64),
    )

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


@pytest.mark.parametrize(
    "overrides", [["trainer.loss.policy_loss=reverse_kl"], ["trainer.teacher.address=127.0.0.1:1"]]
)
def test_a_teacher_and_the_reverse_kl_loss_are_configured_together_or_not_at_all(overrides: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"teacher\.address"):
        load_run_config(None, overrides)


def _distill_gradients(model_dir: Path, baseline: DistillBaseline, micro_batch_size: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = load_model(ModelConfig(path=model_dir))
    cfg = TrainerConfig(
        loss=LossConfig(policy_loss=PolicyLoss.REVERSE_KL, distill_baseline=baseline), micro_batch_size=micro_batch_size
    )
    learner = Learner(model, cfg, 0, torch.device("cpu"), max_completion_tokens=3)
    episodes = _episodes(model, shift=0.0)
    teacher = [[-0.5 * (i + 1) - 0.1 * t for t in range(len(e.completion_token_ids))] for i, e in enumerate(episodes)]
    learner.rl_gradients(StepBatch.of(episodes, teacher=teacher))
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def test_group_baselines_reach_the_loss_and_give_the_same_gradient_for_any_micro_batch_split(
    tiny_model_dir: Path,
) -> None:
    whole = _distill_gradients(tiny_model_dir, DistillBaseline.GROUP, micro_batch_size=4)
    split = _distill_gradients(tiny_model_dir, DistillBaseline.GROUP, micro_batch_size=1)
    raw = _distill_gradients(tiny_model_dir, DistillBaseline.NONE, micro_batch_size=4)

    # the baselines are computed per group before the split: only float32 summation order differs
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-6)
    assert (raw - whole).abs().max() > 1e-3  # the baseline changed the gradient
