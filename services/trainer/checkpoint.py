"""Checkpoints under <output_dir>/checkpoints: one path to save and restore.

Layout of ``step_000050/``: ``model/`` (a standard Hugging Face directory that inference and transformers
load directly, tokenizer included) and ``trainer_state.pt`` (optimizer, step, weight version, RNG states).
A checkpoint is written to ``step_000050.tmp`` and renamed when complete, so a directory named ``step_*``
is always whole. The newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass
class CheckpointState:
    step: int
    weight_version: int
    extra: dict[str, Any]


def save_checkpoint(root: Path, step: int, weight_version: int, model: Any, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, keep: int, extra: dict[str, Any] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(str(tmp / "model"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "model"))
    torch.save({
        "step": step, "weight_version": weight_version, "optimizer": optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, "extra": extra or {},
    }, tmp / "trainer_state.pt")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("saved checkpoint %s", final)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / "trainer_state.pt").is_file())


def load_trainer_state(path: Path, optimizer: torch.optim.Optimizer) -> CheckpointState:
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return CheckpointState(step=int(state["step"]), weight_version=int(state["weight_version"]),
                           extra=dict(state.get("extra", {})))
