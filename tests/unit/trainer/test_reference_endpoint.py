"""The KL term's reference served by an endpoint (trainer.loss.reference_address): the trainer given the reference's
logprobs of each episode (what ScoreTokens answers) takes the same step as with the frozen copy in its memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relayrl.common.model import load_model
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.loss import KlUse, LossConfig
from relayrl.config.model import ModelConfig
from relayrl.config.optimizer import OptimizerName
from relayrl.config.trainer import OptimizerConfig, TrainerConfig
from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner
from relayrl.trainer.reference import Reference
from tests.synthetic import varied_episodes


def _scores(model: torch.nn.Module, episodes: list[Episode]) -> list[list[float]]:
    """What an inference endpoint serving ``model`` answers: log softmax(logits / T) at each completion token."""
    out = []
    with torch.no_grad():
        for ep in episodes:
            prompt, completion = list(ep.prompt_token_ids), list(ep.completion_token_ids)
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
            logp = torch.log_softmax(logits / (ep.sampling_temperature or 1.0), dim=-1)
            out.append([float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)])
    return out


@pytest.mark.parametrize("use", [KlUse.LOSS, KlUse.REWARD])
def test_reference_logprobs_from_an_endpoint_give_the_same_step_as_the_frozen_copy(
    tmp_path: Path, tiny_model_dir: Path, use: KlUse
) -> None:
    ref_dir = create_tiny_model(
        tmp_path / "ref", TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, seed=5)
    )
    # SGD, so that a weight's step is its gradient: AdamW's first step is about lr x sign(gradient), which turns
    # the rounding of a gradient near 0 into a whole step of either sign (seen in CI: the q_proj weights differed)
    optimizer = OptimizerConfig(name=OptimizerName.SGD, lr=1.0, grad_clip=0.0)
    cfg = TrainerConfig(micro_batch_size=4, optimizer=optimizer, loss=LossConfig(kl_coef=0.5, kl_use=use))
    episodes = varied_episodes()
    local = Learner(
        load_model(ModelConfig(path=tiny_model_dir)),
        cfg,
        0,
        torch.device("cpu"),
        8,
        reference=Reference(load_model(ModelConfig(path=ref_dir))),
    )
    remote = Learner(load_model(ModelConfig(path=tiny_model_dir)), cfg, 0, torch.device("cpu"), 8)

    want = local.rl_step(StepBatch.of(episodes))
    got = remote.rl_step(StepBatch.of(episodes, reference=_scores(load_model(ModelConfig(path=ref_dir)), episodes)))

    if use is KlUse.LOSS:  # (the step statistic is measured on the loss's term only)
        assert want.ref_kl > 0.01  # two different models: the term is there
    # float32 logprobs of the same tokens from a padded batch vs one sequence at a time: rounding only
    assert got.ref_kl == pytest.approx(want.ref_kl, rel=1e-4)
    assert got.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
    before = load_model(ModelConfig(path=tiny_model_dir)).parameters()
    assert any(not torch.equal(p, b) for p, b in zip(local.model.parameters(), before, strict=True))  # it stepped
    for (name, p), q in zip(local.model.named_parameters(), remote.model.parameters(), strict=True):
        # one SGD step (lr 1) from the same weights: the gradients equal up to that rounding
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)
