"""FSDP2 over a device mesh on gloo: 1 rank vs 2 ranks sharded vs 2 ranks replicated compute the same gradient,
and DCP checkpoints reshard 2 ranks -> 1 -> 2 (real processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relayrl.common.model import load_model
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import OptimizerConfig, TrainerConfig
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.dcp_checkpoint import load_state, save_state
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner
from relayrl.trainer.parallel_dims import ParallelDims, apply_fsdp
from tests.conftest import free_port
from tests.distributed.gloo import gloo_group
from tests.synthetic import varied_episodes

pytestmark = pytest.mark.distributed
CFG = TrainerConfig(micro_batch_size=4, optimizer=OptimizerConfig(grad_clip=0.0))


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def _gradients(learner: Learner, episodes: list) -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
    learner.rl_gradients(StepBatch.of(episodes))
    return {n: _full(p.grad) for n, p in learner.model.named_parameters() if p.grad is not None}


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    out = Path(out_dir)
    with gloo_group(rank, port):
        coll = Collectives(dist.group.WORLD, timeout_s=60)
        share = varied_episodes()[:6] if rank == 0 else varied_episodes()[6:]
        replicated = Learner(load_model(ModelConfig(path=Path(model_dir))), CFG, 0, torch.device("cpu"), 8, coll)
        grads = {"replicated": _gradients(replicated, share)}
        mesh = ParallelDims(1, 2, 1, 1, 2).build_mesh("cpu")
        model = apply_fsdp(load_model(ModelConfig(path=Path(model_dir))), mesh)
        sharded = Learner(model, CFG, 0, torch.device("cpu"), 8, coll)
        grads["sharded"] = _gradients(sharded, share)
        sharded._optimizer_step()
        save_state(out / "dcp-2", model, sharded.optimizer)  # 2 ranks, sharded
        grads["sharded_after_step"] = {n: _full(p) for n, p in model.named_parameters()}
        fresh = apply_fsdp(load_model(ModelConfig(path=Path(model_dir))), mesh)
        load_state(out / "dcp-1", fresh)  # written by 1 rank, read sharded over 2
        grads["loaded_from_1"] = {n: _full(p) for n, p in fresh.named_parameters()}
        if rank == 0:
            torch.save(grads, out / "rank0.pt")


@pytest.mark.slow
def test_one_rank_two_sharded_and_two_replicated_ranks_agree_and_checkpoints_reshard(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    single = Learner(load_model(ModelConfig(path=tiny_model_dir)), CFG, 0, torch.device("cpu"), 8)
    expected = _gradients(single, varied_episodes())
    single._optimizer_step()
    save_state(tmp_path / "dcp-1", single.model)  # 1 rank, no process group

    mp.start_processes(
        _rank_main, args=(free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2, start_method="spawn", join=True
    )

    got = torch.load(tmp_path / "rank0.pt")
    assert set(got["sharded"]) == set(got["replicated"]) == set(expected)
    for name, grad in expected.items():
        # float32 sums of the same per-token terms split over ranks (and, sharded, reduce-scattered): rounding
        # of the summation order only, as in tests/distributed/test_trainer_ranks.py
        torch.testing.assert_close(got["replicated"][name], grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got["sharded"][name], grad, rtol=1e-4, atol=1e-6)
    # 1 rank -> 2: the sharded model holds exactly the single-rank weights (a copy, no arithmetic)
    for name, p in single.model.named_parameters():
        torch.testing.assert_close(got["loaded_from_1"][name], p.detach(), rtol=0, atol=0)
    # 2 ranks -> 1: a plain model and optimizer load the sharded checkpoint exactly
    plain = load_model(ModelConfig(path=tiny_model_dir))
    optimizer = torch.optim.AdamW(plain.parameters())
    load_state(tmp_path / "dcp-2", plain, optimizer)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), got["sharded_after_step"][name], rtol=0, atol=0)
    assert len(optimizer.state) == len(list(plain.parameters()))  # AdamW moments restored for every parameter


if __name__ == "__main__":  # spawn re-imports this module
    sys.exit(0)
