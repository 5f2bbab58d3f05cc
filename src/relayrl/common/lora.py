"""LoRA adapters through ``peft``, built the same way by the trainer (to train) and by inference (to serve).

Both wrap the base model loaded from ``model.path`` with ``get_peft_model`` and the ``model.lora`` config, so both
hold the same parameter names; the base weights are frozen (``requires_grad`` false) and the adapter's are not. A
weight update is exactly the parameters that require a gradient (relayrl.common.weights.parameter_specs): with
LoRA the adapter only. The adapter's B matrices start at zero, so base + fresh adapter is the base model.

peft keeps the adapter in float32 over a bfloat16 base (``autocast_adapter_dtype``): the trainer's optimizer
state and the adapter weights are float32 master copies, the forward runs in the base's dtype.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from relayrl.config.lora import LoraConfig
from relayrl.config.typed import ConfigError

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora.enabled", True, "LoRA needs peft: pip install 'relayrl[models]'") from None
    return peft


def peft_config(cfg: LoraConfig) -> Any:
    peft = _peft()
    targets: Any = cfg.target_modules[0] if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def with_lora(model: Any, cfg: LoraConfig, adapter_dir: Path | None = None, trainable: bool = True) -> Any:
    """``model`` wrapped with a fresh adapter, or with the one saved in ``adapter_dir`` (a checkpoint's model
    folder). Its mode (train/eval) is kept."""
    peft = _peft()
    training = model.training
    try:
        if adapter_dir is not None:
            wrapped = peft.PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
        else:
            wrapped = peft.get_peft_model(model, peft_config(cfg))
    except ValueError as exc:  # e.g. a target module the model does not have
        raise ConfigError("model.lora.target_modules", cfg.target_modules, str(exc)) from exc
    wrapped.train(training)
    trainable_n = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    log.info(
        "LoRA adapter (r=%d, alpha=%g, on %s): %.2fM trainable of %.1fM parameters%s",
        cfg.rank,
        cfg.alpha,
        ",".join(cfg.target_modules),
        trainable_n / 1e6,
        total / 1e6,
        f" (from {adapter_dir})" if adapter_dir is not None else "",
    )
    return wrapped


def is_adapter_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()


def merge_adapter(adapter_dir: Path, base_path: Path, out: Path, dtype: Any = None) -> Path:
    """Write base + adapter merged into one plain Hugging Face directory (safetensors, tokenizer included) that
    loads without peft. ``adapter_dir``: a checkpoint's ``model`` folder (or the checkpoint holding it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    peft = _peft()
    if not is_adapter_dir(adapter_dir) and is_adapter_dir(adapter_dir / "model"):
        adapter_dir = adapter_dir / "model"
    if not is_adapter_dir(adapter_dir):
        raise ConfigError("adapter", str(adapter_dir), f"holds no LoRA adapter ({ADAPTER_CONFIG})")
    t0 = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=dtype or torch.float32)
    merged = peft.PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out))
    tok_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_path
    AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(str(out))
    if (base_path / "generation_config.json").is_file() and not (out / "generation_config.json").is_file():
        (out / "generation_config.json").write_bytes((base_path / "generation_config.json").read_bytes())
    log.info("merged %s into %s -> %s (%.1fs)", adapter_dir, base_path, out, time.perf_counter() - t0)
    return out
