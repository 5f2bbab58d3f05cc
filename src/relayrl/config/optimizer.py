"""Configuration of the trainer's optimizer and learning-rate schedule (``trainer.optimizer``), chosen by enums;
the implementations are the registries of relayrl.trainer.optim. Part of
:class:`relayrl.config.trainer.TrainerConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class OptimizerName(StrEnum):
    ADAMW = "adamw"  # torch.optim.AdamW: lr, beta1, beta2, weight_decay
    ADAFACTOR = "adafactor"  # torch.optim.Adafactor: factored second moments (memory ~ rows + columns), no first
    SGD = "sgd"  # torch.optim.SGD: lr, momentum, weight_decay


class LrSchedule(StrEnum):
    CONSTANT = "constant"  # lr after the warm-up
    LINEAR = "linear"  # from lr down to lr x min_lr_ratio at trainer.total_steps
    COSINE = "cosine"  # half a cosine from lr down to lr x min_lr_ratio at trainer.total_steps


@dataclass
class OptimizerConfig:
    name: OptimizerName = field(
        default=OptimizerName.ADAMW,
        metadata={
            "help": "The optimizer: adamw (lr, beta1, beta2, weight_decay); adafactor (lr, weight_decay; factored "
            "second moments, no first moment: about a quarter of AdamW's optimizer memory on matrices); sgd "
            "(lr, momentum, weight_decay)."
        },
    )
    lr: float = field(default=1e-3, metadata={"help": "Peak learning rate (after the warm-up).", "gt": 0})
    weight_decay: float = field(
        default=0.0, metadata={"help": "Weight decay (decoupled for adamw and adafactor).", "ge": 0}
    )
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1.", "ge": 0, "lt": 1})
    beta2: float = field(default=0.99, metadata={"help": "AdamW beta2.", "ge": 0, "lt": 1})
    momentum: float = field(default=0.0, metadata={"help": "SGD momentum.", "ge": 0, "lt": 1})
    schedule: LrSchedule = field(
        default=LrSchedule.CONSTANT,
        metadata={
            "help": "Learning rate after the warm-up: constant; linear or cosine decay from lr to lr x min_lr_ratio "
            "at trainer.total_steps."
        },
    )
    warmup_steps: int = field(
        default=0,
        metadata={
            "help": "Linear learning-rate warm-up: step n (1-based) of the first warmup_steps uses lr x n / "
            "warmup_steps.",
            "ge": 0,
        },
    )
    min_lr_ratio: float = field(
        default=0.0,
        metadata={
            "help": "With schedule linear or cosine: the final learning rate as a fraction of lr.",
            "ge": 0,
            "le": 1,
        },
    )
    grad_clip: float = field(default=1.0, metadata={"help": "Max gradient norm (0: no clipping).", "ge": 0})
    master_weights: bool = field(
        default=True,
        metadata={
            "help": "With model.dtype bfloat16 or float16 and trained parameters in that dtype (full fine-tuning): the "
            "optimizer steps float32 master copies (its state in float32 too) and writes them back rounded, so "
            "updates smaller than the dtype's rounding accumulate instead of being lost. Costs 4 bytes per "
            "trained parameter, plus the optimizer's float32 state. false: the optimizer steps the "
            "low-precision parameters directly."
        },
    )
