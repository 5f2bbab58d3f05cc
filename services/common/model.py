"""Model configuration and loading: a Hugging Face causal LM from a local directory."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from relayrl.common.config import ConfigError

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    """The policy model, shared by inference (serving) and trainer (learning)."""

    path: Path = field(default=Path("models/tiny"), metadata={
        "help": "Local Hugging Face model directory (config.json, safetensors, tokenizer files)."})
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata={
        "help": "Parameter dtype for inference and training."})
    device: str = field(default="cpu", metadata={"help": "torch device: cpu, cuda or cuda:N."})

    def validate(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError("device", self.device, "must be cpu, cuda or cuda:N")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def check_exists(self) -> None:
        """Stop start-up with a clear error when the model directory is missing or incomplete."""
        if not (self.path / "config.json").is_file():
            raise ConfigError("model.path", str(self.path),
                              "must be a Hugging Face model directory containing config.json "
                              "(create the demo model with: relayrl init-model)")


def quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_model(cfg: ModelConfig, path: Path | None = None) -> Any:
    """Load the causal LM (eval mode) in the configured dtype on the configured device."""
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    model_path = path or cfg.path
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=cfg.torch_dtype)
    model.to(torch.device(cfg.device))  # type: ignore[arg-type]
    model.eval()
    log.info("loaded model %s (%s, %.2fM params, %s on %s)", model_path, type(model).__name__,
             sum(p.numel() for p in model.parameters()) / 1e6, cfg.dtype, cfg.device)
    return model


def load_tokenizer(path: Path) -> Any:
    quiet_transformers()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.eos_token_id is None:
        raise ConfigError("model.path", str(path), "the tokenizer must define an eos token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
