"""bench/grad_vs_trl.py's pure parts: TRL's advantages, its input layout, the gradient comparison. TRL itself is
not needed (the bench script compares against it)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from relayrl.config.run import load_run_config
from tests.conftest import REPO, load_bench

gvt = load_bench("grad_vs_trl")


def test_trl_advantages_with_std_scaling_divide_by_sample_std_and_leave_uniform_groups_at_zero() -> None:
    # group 1: mean 0.75, sample std sqrt(0.75 / 3) = 0.5; group 2 scored alike: no advantage
    adv = gvt.trl_advantages([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], group_size=4, scale_by_std=True)

    assert adv[:4] == pytest.approx([0.25 / 0.5001, -0.75 / 0.5001, 0.25 / 0.5001, 0.25 / 0.5001], rel=1e-12)
    assert adv[4:] == [0.0] * 4


def test_trl_advantages_without_std_scaling_are_centred_rewards() -> None:
    assert gvt.trl_advantages([1.0, 0.0, 0.5, 0.5], group_size=2, scale_by_std=False) == [0.5, -0.5, 0.0, 0.0]


def test_trl_inputs_left_pad_prompts_right_pad_completions_and_count_completion_tokens() -> None:
    inputs = gvt.trl_inputs([[5, 6], [7, 8, 9]], [[1], [2, 3]], pad_id=0, advantages=[0.5, -0.5])

    assert inputs["prompt_ids"].tolist() == [[0, 5, 6], [7, 8, 9]]
    assert inputs["prompt_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert inputs["completion_ids"].tolist() == [[1, 0], [2, 3]]
    assert inputs["completion_mask"].tolist() == [[1, 0], [1, 1]]
    assert float(inputs["num_items_in_batch"]) == 3.0


def test_mix_answers_replaces_about_the_asked_fraction_with_the_answer() -> None:
    samples = [[1, 2]] * 1000

    mixed = gvt.mix_answers(samples, [9, 0], 0.5, random.Random(0))

    replaced = sum(m == [9, 0] for m in mixed)
    assert 450 <= replaced <= 550  # binomial(1000, 0.5): 3 standard deviations is about 47
    assert all(m in ([9, 0], [1, 2]) for m in mixed)


def test_compare_of_a_scaled_gradient_reports_cosine_one_and_the_scale() -> None:
    a = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([0.5])}
    b = {k: 2.0 * v for k, v in a.items()}

    result = gvt.compare(a, b)

    # exact multiples in float64: equal up to rounding of the norms
    assert result["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert result["min_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert result["norm_ratio"] == pytest.approx(2.0, rel=1e-12)


def test_compare_of_gradients_over_different_parameters_raises() -> None:
    with pytest.raises(ValueError, match="different parameters"):
        gvt.compare({"w": torch.ones(2)}, {"v": torch.ones(2)})


def test_expected_ratio_is_population_over_sample_std_for_grpo_and_one_for_dr_grpo() -> None:
    path = REPO / "examples" / "quickstart.yaml"

    grpo = gvt.expected_ratio(load_run_config(path))
    dr = gvt.expected_ratio(load_run_config(path, ["trainer.loss.advantage=dr_grpo"]))

    assert grpo == pytest.approx(math.sqrt(16 / 15), rel=1e-12)  # quickstart groups of 16
    assert dr == 1.0
