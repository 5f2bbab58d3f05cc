"""Model configuration and loading: a Hugging Face causal LM from a local directory."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from relayrl.config.model import ModelConfig
from relayrl.config.typed import ConfigError

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
    log.info(
        "loaded model %s (%s, %.2fM params, %s on %s)",
        model_path,
        type(model).__name__,
        sum(p.numel() for p in model.parameters()) / 1e6,
        cfg.dtype,
        cfg.device,
    )
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


def end_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The ids that end a sample: the tokenizer's EOS, then every ``eos_token_id`` of the model's generation
    config (an int or a list: chat models list their end-of-turn token there, e.g. ``<|im_end|>``, ``<|eot_id|>``)."""
    ids = [int(tokenizer.eos_token_id)]
    value = getattr(generation_config, "eos_token_id", None)
    for v in value if isinstance(value, list) else [value]:
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    return ids


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of a conversation rendered once with the tokenizer's chat template and the generation prompt
    (special tokens, BOS included, exactly where the template writes them: nothing is added around it).
    ValueError when the tokenizer has no chat template or the rendering fails."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: use prompt text or token ids")
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # a template's own raise_exception(), a missing variable
        raise ValueError(f"the chat template could not render these messages: {exc}") from exc
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]


def load_generation_config(path: Path) -> Any:
    """The directory's ``generation_config.json`` (None when it has none)."""
    quiet_transformers()
    from transformers import GenerationConfig

    if not (Path(path) / "generation_config.json").is_file():
        return None
    return GenerationConfig.from_pretrained(str(path))
