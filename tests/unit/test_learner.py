"""The learner's off-policy corrections on the real tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relayrl.common.model import load_model
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import LossConfig, OffPolicyCorrection, OptimizerConfig, TrainerConfig
from relayrl.trainer.learner import Learner, pack
from relayrl.trainer.loss import token_logprobs


def _episodes(model: torch.nn.Module, shift: float) -> list[Episode]:
    """Two groups of two; behaviour logprobs = the model's own logprobs + shift."""
    prompts, completions = [[3, 4], [3, 4], [5, 6], [5, 6]], [[7, 8, 1], [9, 1], [7, 1], [8, 9, 1]]
    batch = pack(prompts, completions, None, None, [1.0] * 4, pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        logp = token_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                              batch.targets, batch.temperature)
    eps = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        own = logp[i, len(p) - 1 : len(p) - 1 + len(c)]
        eps.append(Episode(episode_id=str(i), group_id=f"g{i // 2}", group_size=2, prompt_token_ids=p,
                           completion_token_ids=c, behaviour_logprobs=(own + shift).tolist(),
                           token_weight_versions=[1] * len(c), loss_mask=[1] * len(c),
                           reward=float(i % 2), sampling_temperature=1.0))
    return eps


def _update(model_dir: Path, correction: OffPolicyCorrection, shift: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = load_model(ModelConfig(path=model_dir))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = TrainerConfig(loss=LossConfig(off_policy=correction), optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0))
    learner = Learner(model, cfg, 0, torch.device("cpu"), max_completion_tokens=3)
    stats = learner.rl_step(_episodes(model, shift))
    assert stats.tokens == 10
    return {k: v.detach() - before[k] for k, v in model.named_parameters()}


@pytest.mark.parametrize("correction", [OffPolicyCorrection.DECOUPLED_PPO, OffPolicyCorrection.TIS])
def test_corrections_equal_plain_ppo_when_behaviour_is_on_policy(tiny_model_dir: Path,
                                                                 correction: OffPolicyCorrection) -> None:
    plain = _update(tiny_model_dir, OffPolicyCorrection.NONE, shift=0.0)
    corrected = _update(tiny_model_dir, correction, shift=0.0)

    for name, delta in plain.items():
        # same gradients up to float32 rounding of exp(0) products; AdamW's first step is ~lr * sign(grad)
        torch.testing.assert_close(corrected[name], delta, rtol=1e-4, atol=1e-6)


def test_decoupled_ppo_differs_from_plain_ppo_when_behaviour_is_stale(tiny_model_dir: Path) -> None:
    plain = _update(tiny_model_dir, OffPolicyCorrection.NONE, shift=-0.7)
    corrected = _update(tiny_model_dir, OffPolicyCorrection.DECOUPLED_PPO, shift=-0.7)

    assert any(not torch.allclose(corrected[n], plain[n], rtol=1e-3, atol=1e-6) for n in plain)
