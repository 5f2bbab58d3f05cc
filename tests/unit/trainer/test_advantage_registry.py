"""Advantage estimators of the registry and DAPO's overlong penalty against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.config.loss import AdvantageEstimator
from relayrl.trainer.losses.advantages import (
    ESTIMATORS,
    Groups,
    advantages,
    moments,
    overlong_penalty,
    reinforce_pp_values,
)


def test_every_estimator_of_the_config_enum_is_registered() -> None:
    assert set(ESTIMATORS) == set(AdvantageEstimator)


def test_reinforce_pp_normalises_rewards_over_the_whole_batch() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])

    adv = advantages(AdvantageEstimator.REINFORCE_PP, rewards, groups, num_groups=2, eps=0.0)

    # batch mean 0.5; deviations +-0.5 (x4) and 0 (x2): population variance 1/6, std 0.408248
    s = 0.5 / math.sqrt(1 / 6)
    torch.testing.assert_close(adv, torch.tensor([s, -s, -s, s, 0.0, 0.0]), rtol=0, atol=1e-6)  # float32 rounding


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_normalises_over_the_batch() -> None:
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])

    adv = advantages(AdvantageEstimator.REINFORCE_PP_BASELINE, rewards, groups, num_groups=2, eps=0.0)

    # centred (0.5, -0.5, 1, -1): batch mean 0, population variance (0.25 + 0.25 + 1 + 1) / 4 = 0.625
    s = math.sqrt(0.625)
    torch.testing.assert_close(adv, torch.tensor([0.5 / s, -0.5 / s, 1 / s, -1 / s]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", [AdvantageEstimator.REINFORCE_PP, AdvantageEstimator.REINFORCE_PP_BASELINE])
def test_reinforce_pp_with_summed_moments_of_two_halves_equals_the_whole_batch(kind: AdvantageEstimator) -> None:
    rewards = torch.tensor([1.0, 0.0, 0.25, 0.75, 0.5, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    whole = advantages(kind, rewards, groups, num_groups=4, eps=1e-6)

    halves = [(rewards[:4], groups[:4], 2), (rewards[4:], groups[4:] - 2, 2)]
    total = sum(moments(reinforce_pp_values(kind, Groups(r, g, n))) for r, g, n in halves)  # what ranks all-reduce
    assert isinstance(total, torch.Tensor)
    parts = [advantages(kind, r, g, n, eps=1e-6, batch_moments=total) for r, g, n in halves]

    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-6)  # float64 moments, float32 output


def test_rloo_leaves_each_member_out_of_its_own_baseline() -> None:
    adv = advantages(AdvantageEstimator.RLOO, torch.tensor([1.0, 0.0, 0.0, 2.0]), torch.tensor([0, 0, 0, 1]), 2)

    # group 0: 1 - 0 = 1; 0 - (1 + 0) / 2 = -0.5 (twice); group of one: 0
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, 0.0]), rtol=0, atol=0)


def test_dr_grpo_is_the_reward_minus_the_group_mean() -> None:
    adv = advantages(AdvantageEstimator.DR_GRPO, torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1]), 2)

    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 1.0, -1.0]), rtol=0, atol=0)


def test_overlong_penalty_is_zero_before_the_buffer_linear_inside_and_full_beyond() -> None:
    lengths = torch.tensor([5, 6, 8, 10, 11])

    penalty = overlong_penalty(lengths, max_tokens=10, buffer_tokens=4, factor=1.0)

    # buffer starts after 10 - 4 = 6 tokens: 8 -> (6 - 8) / 4 = -0.5; 10 -> -1; beyond 10 -> -1
    torch.testing.assert_close(
        penalty, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0], dtype=torch.float64), rtol=0, atol=1e-12
    )


def test_overlong_penalty_off_when_the_buffer_is_zero() -> None:
    penalty = overlong_penalty(torch.tensor([100]), max_tokens=10, buffer_tokens=0, factor=1.0)

    assert float(penalty[0]) == 0.0


def test_deprecated_off_policy_still_selects_its_loss_and_a_contradiction_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from relayrl.config import load_run_config
    from relayrl.config.loss import PolicyLoss
    from relayrl.config.typed import ConfigError

    with caplog.at_level("WARNING"):
        cfg = load_run_config(None, ["trainer.loss.off_policy=tis"])
    assert cfg.trainer.loss.effective_policy_loss() is PolicyLoss.TIS
    assert "trainer.loss.off_policy is deprecated" in caplog.text
    with pytest.raises(ConfigError) as info:
        load_run_config(None, ["trainer.loss.off_policy=tis", "trainer.loss.policy_loss=gspo"])
    assert info.value.field == "trainer.loss.off_policy"
