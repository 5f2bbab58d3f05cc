"""Packed micro-batches: the plan, the row's tensors, and the same logprobs and gradients as padded rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relayrl.common.model import load_model
from relayrl.config.loss import LossAggregation, LossConfig, MismatchMask, PolicyLoss
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import MicroBatchLayout, TrainerConfig
from relayrl.trainer.batching import pack, pack_row, plan_packed
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner
from relayrl.trainer.reference import model_logprobs
from tests.synthetic import varied_episodes


def test_plan_packed_fills_rows_first_fit_decreasing_within_the_budget() -> None:
    lengths = [7, 3, 5, 2, 9, 4]

    plan = plan_packed(lengths, 10)

    assert sorted(i for row in plan for i in row) == list(range(6))
    assert all(sum(lengths[i] for i in row) <= 10 for row in plan)
    # longest first, each into the first row with room: 9 | 7 + 3 | 5 + 4 | 2 (rooms left 1, 0, 1)
    assert plan == [[4], [0, 1], [2, 5], [3]]


def test_plan_packed_puts_a_sequence_longer_than_the_budget_alone() -> None:
    assert plan_packed([12, 3], 10) == [[0], [1]]


def test_pack_row_restarts_positions_and_aligns_targets_per_sequence() -> None:
    mb = pack_row([[3, 4], [5]], [[6, 7], [8, 9]], [[-0.1, -0.2], [-0.3, -0.4]], None, [1.0, 0.5], torch.device("cpu"))

    # sequence 0: 3 4 6 7 -> inputs 3 4 6, targets 4 6 7; sequence 1: 5 8 9 -> inputs 5 8, targets 8 9
    assert mb.input_ids.tolist() == [[3, 4, 6, 5, 8]]
    assert mb.targets.tolist() == [[4, 6, 7, 8, 9]]
    assert mb.position_ids is not None and mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.mask.tolist() == [[0.0, 1.0, 1.0, 1.0, 1.0]]
    assert mb.sequence_index().tolist() == [[0, 0, 0, 1, 1]]
    torch.testing.assert_close(mb.behaviour_logprobs, torch.tensor([[0.0, -0.1, -0.2, -0.3, -0.4]]))
    assert mb.temperature.tolist() == [[1.0, 1.0, 1.0, 0.5, 0.5]]
    assert mb.attention_mask is None and mb.sequences() == 2


def test_packed_row_logprobs_equal_padded_rows(tiny_model_dir: Path) -> None:
    model = load_model(ModelConfig(path=tiny_model_dir))
    eps = varied_episodes(6, seed=4)
    prompts, completions = [e.prompt_token_ids for e in eps], [e.completion_token_ids for e in eps]
    padded = pack(prompts, completions, None, None, [1.0] * 6, 0, torch.device("cpu"))
    packed = pack_row(prompts, completions, None, None, [1.0] * 6, torch.device("cpu"))

    with torch.no_grad():
        rows = model_logprobs(model, padded)
        flat = model_logprobs(model, packed)[0]

    start = 0
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        n = len(p) + len(c) - 1
        # the same attention over the same tokens: float32 rounding of differently shaped matmuls only
        torch.testing.assert_close(flat[start : start + n], rows[i, :n], rtol=1e-5, atol=1e-5)
        start += n


def _gradients(model_dir: Path, cfg: TrainerConfig) -> tuple[dict[str, torch.Tensor], float]:
    model = load_model(ModelConfig(path=model_dir))
    learner = Learner(model, cfg, 0, torch.device("cpu"), max_completion_tokens=8)
    episodes = varied_episodes(seed=3)
    # reverse_kl needs the teacher's logprobs of each completion: a fixed shift of the behaviour's, laid out by the
    # learner like them (packed rows or padded ones)
    teacher = (
        [[lp - 0.1 * (i % 3) for i, lp in enumerate(ep.behaviour_logprobs)] for ep in episodes]
        if cfg.loss.policy_loss is PolicyLoss.REVERSE_KL
        else None
    )
    stats = learner.rl_gradients(StepBatch.of(episodes, teacher=teacher))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stats.loss


@pytest.mark.parametrize("policy", list(PolicyLoss))
def test_packed_micro_batches_give_the_gradient_of_padded_ones(tiny_model_dir: Path, policy: PolicyLoss) -> None:
    loss = LossConfig(
        policy_loss=policy,
        loss_aggregation=LossAggregation.SEQUENCE_MEAN,
        mismatch_mask=MismatchMask.GEOMETRIC,
        mismatch_low=0.2,
        mismatch_high=5.0,
    )
    padded, padded_loss = _gradients(tiny_model_dir, TrainerConfig(micro_batch_size=64, loss=loss))
    packed, packed_loss = _gradients(
        tiny_model_dir, TrainerConfig(micro_batch_tokens=24, micro_batch_layout=MicroBatchLayout.PACKED, loss=loss)
    )

    for name, grad in padded.items():
        # the same per-token terms; only float32 summation order and matmul shapes differ
        torch.testing.assert_close(packed[name], grad, rtol=1e-4, atol=1e-6)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5, abs=1e-7)


class _IgnoresPositions(torch.nn.Module):
    """A model that drops the position ids: packed sequences attend to each other (what the check must catch)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.inner.get_input_embeddings()  # type: ignore[operator, no-any-return]

    def forward(self, **kwargs: object) -> object:
        kwargs.pop("position_ids")
        return self.inner(**kwargs)


def test_the_start_up_check_accepts_a_model_that_keeps_packed_sequences_apart_and_refuses_one_that_does_not(
    tiny_model_dir: Path,
) -> None:
    from relayrl.config.typed import ConfigError
    from relayrl.trainer.batching import packing_error
    from relayrl.trainer.runtime import check_packing

    model = load_model(ModelConfig(path=tiny_model_dir))

    assert packing_error(model, torch.device("cpu")) < 1e-5  # float32 rounding only
    check_packing(model, torch.device("cpu"))
    with pytest.raises(ConfigError) as info:
        check_packing(_IgnoresPositions(model), torch.device("cpu"))
    assert info.value.field == "trainer.micro_batch_layout"
