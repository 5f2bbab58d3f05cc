"""Checkpoints under <output_dir>/checkpoints: one path to save and restore.

Layout of ``step_000050/``: ``model/`` (a standard Hugging Face directory that inference and transformers
load directly, tokenizer included), ``trainer_state.pt`` (optimizer, step, weight version, counters) and one
``rank<R>.pt`` per rank (its RNG states and the ids of the groups it consumed since the previous checkpoint).
Every rank writes into ``step_000050.tmp``; once all ranks report their part written, rank 0 fsyncs and
renames it, so a directory named ``step_*`` is always complete. The newest ``keep`` are kept.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relayrl.trainer.collectives import Collectives

log = logging.getLogger(__name__)


@dataclass
class CheckpointState:
    step: int
    weight_version: int
    extra: dict[str, Any]
    consumed_ids: set[str]


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: Path, step: int, weight_version: int, model: Any, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, keep: int, extra: dict[str, Any],
                    coll: Collectives | None = None, consumed_ids: list[str] | None = None) -> Path:
    """Collective over ``coll``'s ranks; returns the final path once the checkpoint is durable."""
    coll = coll or Collectives(None, timeout_s=60.0)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if coll.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    ready = torch.ones(1)
    coll.all_reduce(ready, dist.ReduceOp.SUM, "checkpoint_folder_ready")
    torch.save({"consumed_ids": list(consumed_ids or []),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}, tmp / f"rank{coll.rank}.pt")
    if coll.rank == 0:
        model.save_pretrained(str(tmp / "model"))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "model"))
        torch.save({"step": step, "weight_version": weight_version, "optimizer": optimizer.state_dict(),
                    "world_size": coll.world_size, "extra": extra}, tmp / "trainer_state.pt")
    written = torch.ones(1)
    coll.all_reduce(written, dist.ReduceOp.SUM, "checkpoint_parts_written")
    durable = torch.zeros(1)
    if coll.rank == 0:
        if int(written.item()) != coll.world_size:
            raise RuntimeError(f"checkpoint {final.name}: {int(written.item())} of {coll.world_size} parts written")
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(root)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        durable[0] = 1
        log.info("saved checkpoint %s", final)
    coll.all_reduce(durable, dist.ReduceOp.MAX, "checkpoint_durable")
    if durable.item() != 1:
        raise RuntimeError(f"checkpoint {final.name} was not made durable by rank 0")
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / "trainer_state.pt").is_file())


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_trainer_state(path: Path, optimizer: torch.optim.Optimizer, rank: int) -> CheckpointState:
    """Restore optimizer and this rank's RNG; consumed ids are the union over every rank's part (a rank of a
    smaller world also reads the groups of ranks that are gone, whose entries rank 0 claims)."""
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    consumed: set[str] = set()
    for part in sorted(path.glob("rank*.pt")):
        data = torch.load(part, weights_only=False)
        consumed.update(data["consumed_ids"])
        if part.name == f"rank{rank}.pt":
            torch.set_rng_state(data["rng"]["torch"])
            random.setstate(data["rng"]["python"])
    return CheckpointState(step=int(state["step"]), weight_version=int(state["weight_version"]),
                           extra=dict(state.get("extra", {})), consumed_ids=consumed)
