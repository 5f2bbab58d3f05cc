"""The learner on the real tiny model: off-policy corrections, micro-batch splits, padding and host reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from relayrl.common.model import load_model
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.loss import LossAggregation, LossConfig, OffPolicyCorrection
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import OptimizerConfig, TrainerConfig
from relayrl.trainer import learner as learner_module
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner, StepStats, pack
from relayrl.trainer.logprobs import token_logprobs
from tests.synthetic import varied_episodes


def _episodes(model: torch.nn.Module, shift: float) -> list[Episode]:
    """Two groups of two; behaviour logprobs = the model's own logprobs + shift."""
    prompts, completions = [[3, 4], [3, 4], [5, 6], [5, 6]], [[7, 8, 1], [9, 1], [7, 1], [8, 9, 1]]
    batch = pack(prompts, completions, None, None, [1.0] * 4, pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        logp = token_logprobs(
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
            batch.targets,
            batch.temperature,
        )
    eps = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        own = logp[i, len(p) - 1 : len(p) - 1 + len(c)]
        eps.append(
            Episode(
                episode_id=str(i),
                group_id=f"g{i // 2}",
                group_size=2,
                prompt_token_ids=p,
                completion_token_ids=c,
                behaviour_logprobs=(own + shift).tolist(),
                token_weight_versions=[1] * len(c),
                loss_mask=[1] * len(c),
                reward=float(i % 2),
                sampling_temperature=1.0,
            )
        )
    return eps


def _update(model_dir: Path, correction: OffPolicyCorrection, shift: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = load_model(ModelConfig(path=model_dir))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = TrainerConfig(loss=LossConfig(off_policy=correction), optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0))
    learner = Learner(model, cfg, 0, torch.device("cpu"), max_completion_tokens=3)
    stats = learner.rl_step(StepBatch.of(_episodes(model, shift)))
    assert stats.tokens == 10
    return {k: v.detach() - before[k] for k, v in model.named_parameters()}


@pytest.mark.parametrize("correction", [OffPolicyCorrection.DECOUPLED_PPO, OffPolicyCorrection.TIS])
def test_corrections_equal_plain_ppo_when_behaviour_is_on_policy(
    tiny_model_dir: Path, correction: OffPolicyCorrection
) -> None:
    plain = _update(tiny_model_dir, OffPolicyCorrection.NONE, shift=0.0)
    corrected = _update(tiny_model_dir, correction, shift=0.0)

    for name, delta in plain.items():
        # same gradients up to float32 rounding of exp(0) products; AdamW's first step is ~lr * sign(grad)
        torch.testing.assert_close(corrected[name], delta, rtol=1e-4, atol=1e-6)


def test_decoupled_ppo_differs_from_plain_ppo_when_behaviour_is_stale(tiny_model_dir: Path) -> None:
    plain = _update(tiny_model_dir, OffPolicyCorrection.NONE, shift=-0.7)
    corrected = _update(tiny_model_dir, OffPolicyCorrection.DECOUPLED_PPO, shift=-0.7)

    assert any(not torch.allclose(corrected[n], plain[n], rtol=1e-3, atol=1e-6) for n in plain)


def _gradients(
    model_dir: Path, cfg: TrainerConfig, episodes: list[Episode], collectives: Collectives | None = None
) -> tuple[dict[str, torch.Tensor], StepStats]:
    model = load_model(ModelConfig(path=model_dir))
    learner = Learner(model, cfg, 0, torch.device("cpu"), max_completion_tokens=8, collectives=collectives)
    stats = learner.rl_gradients(StepBatch.of(episodes))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stats


@pytest.mark.parametrize("aggregation", list(LossAggregation))
@pytest.mark.parametrize("correction", list(OffPolicyCorrection))
def test_small_token_micro_batches_give_the_gradient_of_one_big_batch(
    tiny_model_dir: Path, correction: OffPolicyCorrection, aggregation: LossAggregation
) -> None:
    loss = LossConfig(off_policy=correction, loss_aggregation=aggregation)
    one_batch, whole = _gradients(
        tiny_model_dir, TrainerConfig(micro_batch_size=64, loss=loss), varied_episodes(seed=3)
    )
    by_tokens, split = _gradients(
        tiny_model_dir, TrainerConfig(micro_batch_tokens=12, loss=loss), varied_episodes(seed=3)
    )

    assert split.tokens == whole.tokens == sum(1 + (i * 5) % 7 for i in range(12))
    for name, grad in one_batch.items():
        # float32 sums of the same per-token terms in another order (micro-batches, padding lengths): only
        # rounding differs, a few ulps of the largest partial sums
        torch.testing.assert_close(by_tokens[name], grad, rtol=1e-4, atol=1e-6)
    # the statistics are the same sums, accumulated in float64
    assert split.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    assert split.importance_max == pytest.approx(whole.importance_max, rel=1e-5)


class _MoreMicroBatchesElsewhere(Collectives):
    """One rank of several whose peer needs ``extra`` more micro-batches: the MAX all-reduce returns that."""

    def __init__(self, extra: int) -> None:
        super().__init__(None, timeout_s=10)
        self.extra = extra

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, name: str) -> torch.Tensor:
        if name == "micro_batch_count":
            tensor += self.extra
        return super().all_reduce(tensor, op, name)


def test_padding_micro_batches_contribute_exactly_zero(tiny_model_dir: Path) -> None:
    cfg = TrainerConfig(micro_batch_tokens=20)
    alone, stats = _gradients(tiny_model_dir, cfg, varied_episodes(seed=3))
    padded, padded_stats = _gradients(tiny_model_dir, cfg, varied_episodes(seed=3), _MoreMicroBatchesElsewhere(3))

    for name, grad in alone.items():
        # a padding micro-batch has zero mask and advantage: it adds exact zeros to every gradient
        torch.testing.assert_close(padded[name], grad, rtol=0, atol=0)
    assert padded_stats == stats


def test_the_micro_batch_loop_reads_no_tensor_on_the_host(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host reads (.item(), .tolist(), float(t), int(t)) from the trainer's own code: as many with 12
    micro-batches as with one, so none happens per micro-batch (the model's own code is not counted)."""
    reads: list[str] = []
    trainer_dir = str(Path(learner_module.__file__).parent)
    for method in ("item", "tolist", "__float__", "__int__"):
        original = getattr(torch.Tensor, method)

        def counted(self: torch.Tensor, *args: object, _orig: object = original, _name: str = method) -> object:
            if sys._getframe(1).f_code.co_filename.startswith(trainer_dir):
                reads.append(_name)
            return _orig(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, method, counted)
    counts = []
    for cfg in (TrainerConfig(micro_batch_size=64), TrainerConfig(micro_batch_size=1)):
        reads.clear()
        _gradients(tiny_model_dir, cfg, varied_episodes(seed=3))
        counts.append(len(reads))

    assert counts[0] == counts[1] <= 5  # counts, agreed count, statistics: a fixed few per step
