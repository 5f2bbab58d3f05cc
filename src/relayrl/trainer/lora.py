"""The trainer's policy model: the base model, with LoRA adapters when ``model.lora.enabled``.

A LoRA checkpoint's ``model`` folder holds only the adapter (peft's ``save_pretrained`` of the wrapped model):
resuming loads the base from ``model.path`` and that adapter on it, trainable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relayrl.common.lora import is_adapter_dir, with_lora
from relayrl.common.model import load_model
from relayrl.config.model import ModelConfig


def load_policy(cfg: ModelConfig, checkpoint_model: Path | None = None) -> Any:
    """The model to train: full weights from ``checkpoint_model`` (or ``cfg.path``), or base + adapter."""
    if not cfg.lora.enabled:
        return load_model(cfg, checkpoint_model)
    adapter = checkpoint_model if checkpoint_model is not None and is_adapter_dir(checkpoint_model) else None
    if checkpoint_model is not None and adapter is None:
        raise RuntimeError(
            f"{checkpoint_model} holds full weights, not a LoRA adapter: resume it with "
            "model.lora.enabled=false, or start a new run"
        )
    return with_lora(load_model(cfg), cfg.lora, adapter, trainable=True)
