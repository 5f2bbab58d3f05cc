"""The trainer trains on loss-mask-1 tokens only: a multi-turn episode's observation tokens (mask 0) are context, not
targets. Checked against the loss and gradient computed by hand on the real tiny model."""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.common.model import load_model
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.loss import LossAggregation, LossConfig, PolicyLoss
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import OptimizerConfig, TrainerConfig
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner

PROMPT = [3, 4, 5]
# model turn (mask 1), observation (mask 0), model turn (mask 1)
COMPLETIONS = [[6, 7, 8, 9, 10, 6, 7], [8, 6, 9, 9, 7, 10, 1]]
MASK = [1, 1, 0, 0, 0, 1, 1]
REWARDS = [1.0, 0.0]


def _own_logprobs(model: torch.nn.Module, completion: list[int]) -> torch.Tensor:
    """log pi(token | everything before it) of each completion token, at temperature 1."""
    ids = torch.tensor([PROMPT + completion])
    logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def _episodes(model: torch.nn.Module, observation_logprob: float) -> list[Episode]:
    """On-policy episodes (behaviour = the model's own logprobs on model tokens); observation tokens carry
    ``observation_logprob`` (rollout writes 0.0), which a mask-1-only loss never reads."""
    eps = []
    with torch.no_grad():
        for i, (c, r) in enumerate(zip(COMPLETIONS, REWARDS, strict=True)):
            own = _own_logprobs(model, c).tolist()
            behaviour = [lp if m else observation_logprob for lp, m in zip(own, MASK, strict=True)]
            eps.append(
                Episode(
                    episode_id=str(i),
                    group_id="g",
                    group_size=2,
                    sample_index=i,
                    prompt_token_ids=PROMPT,
                    completion_token_ids=c,
                    behaviour_logprobs=behaviour,
                    token_weight_versions=[1] * len(c),
                    loss_mask=MASK,
                    reward=r,
                    sampling_temperature=1.0,
                )
            )
    return eps


def _learner_gradients(model_dir: Path, observation_logprob: float) -> tuple[dict[str, torch.Tensor], float]:
    model = load_model(ModelConfig(path=model_dir))
    cfg = TrainerConfig(
        loss=LossConfig(policy_loss=PolicyLoss.PPO_CLIP, loss_aggregation=LossAggregation.TOKEN_MEAN),
        optimizer=OptimizerConfig(lr=1e-3, grad_clip=0.0),
    )
    learner = Learner(model, cfg, 0, torch.device("cpu"), max_completion_tokens=16)
    stats = learner.rl_gradients(StepBatch.of(_episodes(model, observation_logprob)))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stats.loss


def test_loss_and_gradient_equal_the_hand_computed_mask_one_loss(tiny_model_dir: Path) -> None:
    grads, loss = _learner_gradients(tiny_model_dir, observation_logprob=0.0)

    # by hand: GRPO advantages of rewards (1, 0) are +-0.5 / (0.5 + eps); on-policy PPO's ratio is 1, so the
    # token-mean loss is -(1/T) sum over mask-1 tokens of A_i * ratio_t, T = the mask-1 tokens of the batch
    model = load_model(ModelConfig(path=tiny_model_dir))
    adv = [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)]
    keep = torch.tensor(MASK, dtype=torch.float32)
    total_tokens = keep.sum() * len(COMPLETIONS)
    hand = torch.zeros(())
    for c, a in zip(COMPLETIONS, adv, strict=True):
        logp = _own_logprobs(model, c)
        ratio = torch.exp(logp - logp.detach())  # 1, with the gradient of logp
        hand = hand - (a * ratio * keep).sum() / total_tokens
    hand.backward()

    # the loss value: 1e-5 absorbs float32 rounding of exp(logp - behaviour) around 1
    assert abs(loss - float(hand.detach())) < 1e-5
    for name, p in model.named_parameters():
        if p.grad is not None:  # the same graph up to float32 summation order
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-7)


def test_observation_tokens_logprobs_do_not_change_the_gradient(tiny_model_dir: Path) -> None:
    zero, _ = _learner_gradients(tiny_model_dir, observation_logprob=0.0)
    garbage, _ = _learner_gradients(tiny_model_dir, observation_logprob=-50.0)  # ratio e^50 if it were read

    for name, g in zero.items():
        torch.testing.assert_close(garbage[name], g, rtol=0, atol=0)  # mask-0 tokens are never read: bit-equal
