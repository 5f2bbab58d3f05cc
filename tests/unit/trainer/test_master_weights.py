"""bfloat16 full fine-tuning: AdamW steps float32 master weights, so updates below bfloat16's rounding are kept."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from relayrl.common.model import load_model
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import OptimizerConfig, TrainerConfig
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner
from relayrl.trainer.master_weights import MasterWeightAdamW
from tests.synthetic import varied_episodes

LR = 1e-4  # AdamW's step is about lr * sign(grad): 1e-4, far below half a bfloat16 ulp at 1.0 (2^-8 = 3.9e-3)


def _steps(optimizer: torch.optim.Optimizer, weight: torch.nn.Parameter, n: int) -> None:
    for _ in range(n):
        weight.grad = torch.ones_like(weight)  # a constant gradient: every step moves the weight down by ~lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_tiny_updates_lost_in_bfloat16_accumulate_with_master_weights() -> None:
    plain_w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    master_w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    plain = torch.optim.AdamW([plain_w], lr=LR, weight_decay=0.0)
    master = MasterWeightAdamW([master_w], lr=LR, weight_decay=0.0)

    _steps(plain, plain_w, 100)
    _steps(master, master_w, 100)

    assert torch.equal(plain_w.detach(), torch.ones(8, dtype=torch.bfloat16))  # every update rounded away
    # 100 steps of ~1e-4: the master is ~0.99; the bfloat16 weight is its rounding (ulp 2^-8 below 1.0)
    torch.testing.assert_close(master.masters[0], torch.full((8,), 0.99), rtol=0, atol=1e-4)
    assert torch.equal(master_w.detach(), master.masters[0].to(torch.bfloat16))
    assert master_w.dtype == torch.bfloat16 and master.state[master.masters[0]]["exp_avg"].dtype == torch.float32


def test_master_weights_survive_a_state_dict_round_trip_exactly() -> None:
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([w], lr=LR, weight_decay=0.0)
    _steps(opt, w, 10)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # as the checkpoint writes it, and reads it back with weights_only
    buf.seek(0)

    w2 = torch.nn.Parameter(w.detach().clone())
    resumed = MasterWeightAdamW([w2], lr=LR, weight_decay=0.0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    _steps(opt, w, 5)
    _steps(resumed, w2, 5)

    assert torch.equal(resumed.masters[0], opt.masters[0])  # float32 values below the bfloat16 ulp restored
    assert torch.equal(w2.detach(), w.detach())


def test_float32_parameters_are_stepped_in_place_without_a_copy() -> None:
    w32 = torch.nn.Parameter(torch.ones(4))
    w16 = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([w32, w16], lr=LR)
    assert opt.masters[0] is w32 and opt.masters[1] is not w16 and opt.low_precision == 1


def test_learner_in_bfloat16_keeps_updates_below_the_rounding_in_float32_masters(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    model = load_model(ModelConfig(path=tiny_model_dir, dtype="bfloat16"))
    before = [p.detach().float().clone() for p in model.parameters()]
    learner = Learner(
        model,
        TrainerConfig(optimizer=OptimizerConfig(lr=1e-5, grad_clip=0.0)),
        0,
        torch.device("cpu"),
        max_completion_tokens=7,
    )
    for _ in range(2):
        learner.rl_step(StepBatch.of(varied_episodes()))

    opt = learner.optimizer
    assert isinstance(opt, MasterWeightAdamW) and opt.low_precision == len(before)
    params = list(model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)  # the forward and what is published stay bfloat16
    assert all(torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(params, opt.masters, strict=True))
    # ~2e-5 of movement: most bfloat16 weights do not change, but their masters hold the update
    kept = sum(
        int(((m != b) & (p.detach().float() == b)).sum()) for p, m, b in zip(params, opt.masters, before, strict=True)
    )
    assert kept > 0.1 * sum(b.numel() for b in before)


def test_learner_without_master_weights_steps_the_bfloat16_parameters(tiny_model_dir: Path) -> None:
    model = load_model(ModelConfig(path=tiny_model_dir, dtype="bfloat16"))
    learner = Learner(model, TrainerConfig(optimizer=OptimizerConfig(master_weights=False)), 0, torch.device("cpu"))
    assert type(learner.optimizer) is torch.optim.AdamW
