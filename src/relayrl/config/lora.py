"""LoRA: train low-rank adapters instead of every weight (``model.lora``; via ``peft``).

In the model section because both sides build the same adapter structure: the trainer trains it, inference serves
base + adapter, and a weight update then carries only the adapter's tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.config.typed import ConfigError

LLAMA_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """Low-rank adapters on the named linear layers; the base weights stay frozen (and are never re-sent)."""

    enabled: bool = field(
        default=False,
        metadata={
            "help": "Train LoRA adapters (requires the `models` extra: peft). Weight updates carry only the adapter; "
            "checkpoints store only the adapter (`relayrl merge-lora` writes a full model)."
        },
    )
    rank: int = field(default=16, metadata={"help": "Adapter rank r.", "ge": 1, "le": 4096})
    alpha: float = field(
        default=32.0, metadata={"help": "Scaling numerator: the update is (alpha / rank) B A.", "gt": 0}
    )
    dropout: float = field(
        default=0.0, metadata={"help": "Dropout on the adapter's input while training.", "ge": 0, "lt": 1}
    )
    target_modules: list[str] = field(
        default_factory=lambda: list(LLAMA_LINEAR),
        metadata={
            "help": "Names (last component) of the linear layers that get an adapter; `all-linear`: every linear "
            "layer except the output layer."
        },
    )

    def validate(self) -> None:
        if self.enabled and not self.target_modules:
            raise ConfigError("target_modules", self.target_modules, "must name at least one module")
        if any(not m for m in self.target_modules):
            raise ConfigError("target_modules", self.target_modules, "module names must not be empty")
