"""The trainer's optimizers and learning-rate schedules as registries chosen by ``trainer.optimizer`` (in the
spirit of torchtitan's ``build_optimizers_fn``): adding one is an entry here and a member of its enum in
relayrl.config.optimizer.

With ``optimizer.master_weights`` and low-precision trained parameters (full fine-tuning in bfloat16 / float16),
the chosen optimizer steps float32 master copies (relayrl.trainer.master_weights).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from relayrl.config.optimizer import LrSchedule, OptimizerConfig, OptimizerName
from relayrl.trainer.master_weights import LOW_PRECISION, with_master_weights

# each optimizer: its class, and its keyword arguments from the config (every one takes lr)
OPTIMIZERS: dict[OptimizerName, tuple[type[torch.optim.Optimizer], Callable[[OptimizerConfig], dict[str, Any]]]] = {
    OptimizerName.ADAMW: (torch.optim.AdamW, lambda c: {"betas": (c.beta1, c.beta2), "weight_decay": c.weight_decay}),
    OptimizerName.ADAFACTOR: (torch.optim.Adafactor, lambda c: {"weight_decay": c.weight_decay}),
    OptimizerName.SGD: (torch.optim.SGD, lambda c: {"momentum": c.momentum, "weight_decay": c.weight_decay}),
}


def build_optimizer(params: Sequence[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The configured optimizer over the model's ``params`` (frozen ones get no gradient, so no update); with
    ``cfg.master_weights`` and low-precision trained parameters, over the trained ones, with float32 masters of the
    low-precision ones. (Which parameters it holds is what a checkpoint's optimizer state is indexed by.)"""
    cls, kwargs = OPTIMIZERS[cfg.name]
    trained = [p for p in params if p.requires_grad]
    if cfg.master_weights and any(p.dtype in LOW_PRECISION for p in trained):
        masters: Callable[..., torch.optim.Optimizer] = with_master_weights(cls)
        return masters(trained, lr=cfg.lr, **kwargs(cfg))
    plain: Callable[..., torch.optim.Optimizer] = cls
    return plain(list(params), lr=cfg.lr, **kwargs(cfg))


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return 1.0 - progress


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# each schedule: the fraction of the way from lr (1) to lr x min_lr_ratio (0) at a progress in [0, 1] after warm-up
SCHEDULES: dict[LrSchedule, Callable[[float], float]] = {
    LrSchedule.CONSTANT: _constant,
    LrSchedule.LINEAR: _linear,
    LrSchedule.COSINE: _cosine,
}


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based: the steps already taken) of ``total_steps``: linear
    warm-up over the first ``cfg.warmup_steps``, then ``cfg.schedule`` down to ``lr x min_lr_ratio`` at the last."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(total_steps - cfg.warmup_steps - 1, 1)
    progress = min(max((step - cfg.warmup_steps) / decay_steps, 0.0), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * SCHEDULES[cfg.schedule](progress))
