"""Model configuration and loading: a Hugging Face causal LM from a local directory."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from relayrl.common.config import ConfigError
from relayrl.config.model import ModelConfig

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    """The torch dtype of ``model.dtype``."""
    return DTYPES[cfg.dtype]


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
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype(cfg))
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
