"""The frozen reference model's KL term in the learner: as a loss term and as a reward penalty."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from relayrl.common.model import load_model
from relayrl.config.loss import AdvantageEstimator, KlEstimator, KlUse, LossConfig
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import TrainerConfig
from relayrl.trainer.batching import pack
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner
from relayrl.trainer.losses.advantages import advantages
from relayrl.trainer.reference import Reference, model_logprobs
from tests.synthetic import varied_episodes


def _learner(model_dir: Path, loss: LossConfig, reference_shift: float | None) -> Learner:
    model = load_model(ModelConfig(path=model_dir))
    ref = None
    if reference_shift is not None:
        ref_model = copy.deepcopy(model)
        with torch.no_grad():
            weight = ref_model.get_output_embeddings().weight
            weight.add_(reference_shift * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
        ref = Reference(ref_model)
    return Learner(model, TrainerConfig(loss=loss), 0, torch.device("cpu"), max_completion_tokens=8, reference=ref)


def _grads(learner: Learner) -> tuple[dict[str, torch.Tensor], float]:
    stats = learner.rl_gradients(StepBatch.of(varied_episodes(seed=3)))
    return {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}, stats.ref_kl


def test_k3_loss_against_an_identical_reference_changes_nothing(tiny_model_dir: Path) -> None:
    plain, _ = _grads(_learner(tiny_model_dir, LossConfig(), None))
    with_kl, ref_kl = _grads(_learner(tiny_model_dir, LossConfig(kl_coef=0.5, kl_estimator=KlEstimator.K3), 0.0))

    # k3 and its gradient (1 - pi_ref / pi) are exactly 0 where pi_ref = pi
    assert ref_kl == 0.0
    for name, grad in plain.items():
        torch.testing.assert_close(with_kl[name], grad, rtol=0, atol=1e-7)  # adds 0.5 * exact zeros


def test_k3_loss_against_a_different_reference_is_positive_and_moves_the_gradient(tiny_model_dir: Path) -> None:
    plain, _ = _grads(_learner(tiny_model_dir, LossConfig(), None))
    with_kl, ref_kl = _grads(_learner(tiny_model_dir, LossConfig(kl_coef=0.5), 0.5))

    assert ref_kl > 0.0  # k3 >= 0, > 0 where the policies differ
    assert any(not torch.allclose(with_kl[n], plain[n], rtol=1e-3, atol=1e-6) for n in plain)


def test_kl_reward_penalty_subtracts_the_summed_k1_from_each_reward(tiny_model_dir: Path) -> None:
    learner = _learner(
        tiny_model_dir,
        LossConfig(kl_coef=0.1, kl_estimator=KlEstimator.K1, kl_use=KlUse.REWARD, advantage=AdvantageEstimator.DR_GRPO),
        0.0,
    )
    eps = varied_episodes(6, seed=5)
    batch = pack(
        [e.prompt_token_ids for e in eps],
        [e.completion_token_ids for e in eps],
        None,
        None,
        [1.0] * 6,
        0,
        torch.device("cpu"),
    )
    with torch.no_grad():
        own = model_logprobs(learner.model, batch)
    for i, e in enumerate(eps):  # behaviour = the reference's logprobs + 0.25 per token: k1 = 0.25 per token
        n_p = len(e.prompt_token_ids)
        e.behaviour_logprobs[:] = (own[i, n_p - 1 : n_p - 1 + len(e.completion_token_ids)] + 0.25).tolist()
    step = StepBatch.of(eps)
    micro = [(rows, learner._micro_batch(step.positions, rows)) for rows in learner._plan(step.positions.sizes)]

    adv = learner._advantages(step, micro)

    shaped = torch.tensor([e.reward - 0.1 * 0.25 * len(e.completion_token_ids) for e in eps])
    expected = advantages(AdvantageEstimator.DR_GRPO, shaped, torch.tensor([i // 3 for i in range(6)]), 2)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-5)  # float32 logprobs summed over <= 7 tokens


@pytest.mark.parametrize("use", list(KlUse))
def test_the_reference_stays_frozen(tiny_model_dir: Path, use: KlUse) -> None:
    learner = _learner(tiny_model_dir, LossConfig(kl_coef=0.5, kl_use=use), 0.1)
    assert learner.reference is not None
    before = {n: p.clone() for n, p in learner.reference.model.named_parameters()}

    learner.rl_step(StepBatch.of(varied_episodes(seed=3)))

    for n, p in learner.reference.model.named_parameters():
        assert p.grad is None and torch.equal(p, before[n])
