"""trainer.optimizer: optimizers and learning-rate schedules chosen from registries (relayrl.trainer.optim), each
a real torch optimizer, each schedule exact at the points that define it, master weights under any of them."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from relayrl.common.model import load_model
from relayrl.config import load_run_config
from relayrl.config.model import ModelConfig
from relayrl.config.optimizer import LrSchedule, OptimizerConfig, OptimizerName
from relayrl.config.trainer import TrainerConfig
from relayrl.config.typed import ConfigError
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner
from relayrl.trainer.master_weights import MasterWeights
from relayrl.trainer.optim import OPTIMIZERS, SCHEDULES, build_optimizer, lr_at
from tests.synthetic import varied_episodes

EXPECTED = {
    OptimizerName.ADAMW: torch.optim.AdamW,
    OptimizerName.ADAFACTOR: torch.optim.Adafactor,
    OptimizerName.SGD: torch.optim.SGD,
}


def test_every_name_and_schedule_of_the_config_has_an_implementation() -> None:
    assert set(OPTIMIZERS) == set(OptimizerName) and set(SCHEDULES) == set(LrSchedule)


@pytest.mark.parametrize("name", list(OptimizerName))
def test_each_optimizer_is_the_torch_class_named_and_its_steps_lower_a_quadratic(name: OptimizerName) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 6))
    optimizer = build_optimizer([w], OptimizerConfig(name=name, lr=0.05, momentum=0.5))
    start = float((w.detach() ** 2).sum())
    for _ in range(20):
        (w**2).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    assert type(optimizer) is EXPECTED[name]
    assert float((w.detach() ** 2).sum()) < 0.9 * start


def test_the_config_arguments_reach_the_optimizer() -> None:
    w = torch.nn.Parameter(torch.zeros(3))
    adamw = build_optimizer([w], OptimizerConfig(lr=0.01, beta1=0.8, beta2=0.95, weight_decay=0.1))
    sgd = build_optimizer([w], OptimizerConfig(name=OptimizerName.SGD, lr=0.02, momentum=0.9))

    assert adamw.defaults["betas"] == (0.8, 0.95) and adamw.defaults["weight_decay"] == 0.1
    assert adamw.defaults["lr"] == 0.01 and sgd.defaults["momentum"] == 0.9 and sgd.defaults["lr"] == 0.02


def test_warm_up_then_a_constant_rate_matches_the_old_warm_up() -> None:
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=4)

    rates = [lr_at(step, cfg, 10) for step in range(10)]

    # exact arithmetic on a handful of floats: the only tolerance is float rounding
    assert rates == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, *[1e-3] * 6], rel=1e-12)


@pytest.mark.parametrize("schedule", [LrSchedule.LINEAR, LrSchedule.COSINE])
def test_decaying_schedules_start_at_lr_after_warm_up_and_end_at_the_floor_on_the_last_step(
    schedule: LrSchedule,
) -> None:
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=2, schedule=schedule, min_lr_ratio=0.1)
    total = 12  # steps 0-1 warm up, 2..11 decay: step 2 is the peak, step 11 the floor

    rates = [lr_at(step, cfg, total) for step in range(total)]

    assert rates[:3] == pytest.approx([5e-4, 1e-3, 1e-3], rel=1e-12)
    assert rates[-1] == pytest.approx(1e-4, rel=1e-12)
    assert all(a >= b for a, b in itertools.pairwise(rates[2:]))  # never rises
    middle = lr_at(2 + 9 / 2, cfg, total)  # half way through the decay (a fractional step is fine for the formula)
    half = 0.5 if schedule is LrSchedule.LINEAR else 0.5 * (1 + math.cos(math.pi / 2))
    assert middle == pytest.approx(1e-3 * (0.1 + 0.9 * half), rel=1e-12)


def test_master_weights_keep_tiny_updates_under_any_optimizer() -> None:
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    # SGD's step lr x 1 = 1e-4, far below half a bfloat16 ulp at 1.0 (3.9e-3): lost without masters
    optimizer = build_optimizer([w], OptimizerConfig(name=OptimizerName.SGD, lr=1e-4))
    for _ in range(100):
        w.grad = torch.ones_like(w)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    assert isinstance(optimizer, MasterWeights) and isinstance(optimizer, torch.optim.SGD)
    # 100 float32 subtractions of 1e-4 from 1.0: each rounds by up to half an ulp (6e-8), hence atol 1e-5
    assert torch.allclose(optimizer.masters[0], torch.full((8,), 0.99), rtol=0, atol=1e-5)
    assert float(w.detach()[0]) < 1.0  # and the bfloat16 weight followed once the masters moved far enough


def test_the_learner_steps_with_the_scheduled_rate(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    model = load_model(ModelConfig(path=tiny_model_dir))
    opt = OptimizerConfig(name=OptimizerName.ADAFACTOR, lr=1e-3, schedule=LrSchedule.COSINE, warmup_steps=1)
    learner = Learner(
        model, TrainerConfig(total_steps=3, optimizer=opt), 0, torch.device("cpu"), max_completion_tokens=7
    )

    rates = [learner.rl_step(StepBatch.of(varied_episodes())).lr for _ in range(3)]

    assert type(learner.optimizer) is torch.optim.Adafactor
    assert rates == pytest.approx([1e-3, 1e-3, 0.0], abs=1e-12)


def test_an_unknown_optimizer_or_schedule_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.optimizer\.name"):
        load_run_config(None, ["trainer.optimizer.name=lion"])
    with pytest.raises(ConfigError, match=r"trainer\.optimizer\.schedule"):
        load_run_config(None, ["trainer.optimizer.schedule=step"])
