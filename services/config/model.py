"""The policy model's section: where it is, its dtype and device (shared by inference and trainer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from relayrl.common.config import ConfigError
from relayrl.config.lora import LoraConfig


@dataclass
class ModelConfig:
    """The policy model, shared by inference (serving) and trainer (learning)."""

    path: Path = field(default=Path("models/tiny"), metadata={
        "help": "Local Hugging Face model directory (config.json, safetensors, tokenizer files)."})
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata={
        "help": "Parameter dtype for inference and training."})
    device: str = field(default="cpu", metadata={"help": "torch device: cpu, cuda or cuda:N."})
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={
        "help": "LoRA adapters (trainer trains them, inference serves base + adapter; updates carry the adapter)."})

    def validate(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError("device", self.device, "must be cpu, cuda or cuda:N")

    def check_exists(self) -> None:
        """Stop start-up with a clear error when the model directory is missing or incomplete."""
        if not (self.path / "config.json").is_file():
            raise ConfigError("model.path", str(self.path),
                              "must be a Hugging Face model directory containing config.json "
                              "(create the demo model with: relayrl init-model)")
