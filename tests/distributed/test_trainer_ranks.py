"""1 rank vs 2 gloo ranks given the same global batch: the same gradients (real processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relayrl.common.model import load_model
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.loss import AdvantageEstimator, LossAggregation, LossConfig, PolicyLoss
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import MicroBatchLayout, TrainerConfig
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner
from tests.conftest import free_port
from tests.distributed.gloo import gloo_group
from tests.synthetic import varied_episodes

pytestmark = pytest.mark.distributed


# the batch-normalised estimator (its moments are all-reduced) with a sequence-level loss, over packed rows
ALGORITHMS = LossConfig(
    advantage=AdvantageEstimator.REINFORCE_PP_BASELINE,
    policy_loss=PolicyLoss.GSPO,
    loss_aggregation=LossAggregation.SEQUENCE_MEAN,
)


def _grads(
    model_dir: Path,
    episodes: list[Episode],
    coll: Collectives,
    micro_batch: int,
    micro_tokens: int = 0,
    packed: bool = False,
) -> dict[str, torch.Tensor]:
    model = load_model(ModelConfig(path=model_dir))
    cfg = TrainerConfig(micro_batch_size=micro_batch, micro_batch_tokens=micro_tokens)
    if packed:
        cfg = TrainerConfig(
            micro_batch_tokens=micro_tokens, micro_batch_layout=MicroBatchLayout.PACKED, loss=ALGORITHMS
        )
    learner = Learner(model, cfg, 0, torch.device("cpu"), max_completion_tokens=8, collectives=coll)
    learner.rl_gradients(StepBatch.of(episodes))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str, mode: str) -> None:
    with gloo_group(rank, port):
        coll = Collectives(dist.group.WORLD, timeout_s=60)
        eps = varied_episodes()
        share = eps[:6] if rank == 0 else eps[6:]  # two whole groups each
        if mode == "packed":  # rows of different budgets: different numbers of micro-batches per rank
            grads = _grads(Path(model_dir), share, coll, 64, micro_tokens=12 if rank == 0 else 40, packed=True)
        elif mode == "by_tokens":  # token budgets that split the two shares into different numbers of micro-batches
            grads = _grads(Path(model_dir), share, coll, micro_batch=64, micro_tokens=9 if rank == 0 else 40)
        else:
            grads = _grads(Path(model_dir), share, coll, micro_batch=2 if rank == 0 else 5)
        torch.save(grads, Path(out_dir) / f"grads{rank}.pt")


@pytest.mark.parametrize("mode", ["by_sequences", "by_tokens", "packed"])
def test_two_ranks_and_one_rank_compute_the_same_gradient(tmp_path: Path, tiny_model_dir: Path, mode: str) -> None:
    single = _grads(
        tiny_model_dir,
        varied_episodes(),
        Collectives(None, timeout_s=60),
        micro_batch=4,
        micro_tokens=30 if mode == "packed" else 0,
        packed=mode == "packed",
    )

    mp.start_processes(
        _rank_main,
        args=(free_port(), str(tiny_model_dir), str(tmp_path), mode),
        nprocs=2,
        start_method="spawn",
        join=True,
    )

    rank0 = torch.load(tmp_path / "grads0.pt")
    rank1 = torch.load(tmp_path / "grads1.pt")
    assert set(rank0) == set(single)
    for name, grad in single.items():
        torch.testing.assert_close(rank0[name], rank1[name], rtol=0, atol=0)  # all-reduced: bit-identical
        # float32 sums over different micro-batch and rank splits: only summation order differs
        torch.testing.assert_close(rank0[name], grad, rtol=1e-4, atol=1e-6)


if __name__ == "__main__":  # spawn re-imports this module
    sys.exit(0)
