"""Checkpoints under <output_dir>/checkpoints: one path to save and restore.

Layout of ``step_000050/``: ``model/`` (a standard Hugging Face directory that inference and transformers
load directly, tokenizer included), ``trainer_state.pt`` (optimizer, step, weight version, counters) and one
``rank<R>.pt`` per rank (its RNG states and the ids of the groups it consumed since the previous checkpoint).

Rank 0 owns every file: the other ranks send it their parts (one all-gather), it writes
``step_000050.tmp``, fsyncs and renames it, so a directory named ``step_*`` is always complete; the newest
``keep`` are kept. On resume rank 0 alone reads the checkpoint and broadcasts what each rank needs (its RNG
state, the optimizer state, the consumed ids; the weights follow with the initial weight broadcast). So the
checkpoint directory only has to be on rank 0's volume: a trainer spread over several nodes needs no shared
(ReadWriteMany) storage. Optimizer state is replicated (gradients are all-reduced), so rank 0's is every rank's.

Sharded (FSDP2, ``trainer.distributed.dp_shard > 1``): no rank holds the whole optimizer state, so model and
optimizer go through ``torch.distributed.checkpoint`` into ``dcp/`` (every rank writes its own shards, which
needs the checkpoint directory shared by the ranks); rank 0 still exports ``model/`` (the full state dict gathered
to its CPU, written through an unsharded copy of the architecture) and ``trainer_state.pt`` without the optimizer.
A checkpoint with ``dcp/`` is restored from it by every rank (relayrl.trainer.dcp_checkpoint: any sharding).
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relayrl.common.checkpoints import STATE_FILE, checkpoint_name, latest_checkpoint, list_checkpoints
from relayrl.config.typed import ConfigError
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.parallel_dims import is_sharded

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


def save_checkpoint(
    root: Path,
    step: int,
    weight_version: int,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    keep: int,
    extra: dict[str, Any],
    coll: Collectives | None = None,
    consumed_ids: list[str] | None = None,
    export_model: Any | None = None,
) -> Path:
    """Collective over ``coll``'s ranks; returns the final path once the checkpoint is durable (on rank 0's
    filesystem). ``export_model``: rank 0's unsharded copy for the Hugging Face export of a sharded model."""
    coll = coll or Collectives(None, timeout_s=60.0)
    final = root / checkpoint_name(step)
    part = {
        "consumed_ids": list(consumed_ids or []),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    parts = coll.all_gather_object(part, "checkpoint_parts")
    export = model
    if is_sharded(model):
        export = _save_shards(root / f"{final.name}.tmp", model, optimizer, coll, export_model)
        optimizer = None  # type: ignore[assignment]  # in dcp/
    durable = torch.zeros(1)
    if coll.rank == 0:
        try:
            _write(root, final, parts, step, weight_version, export, tokenizer, optimizer, keep, extra, coll.world_size)
            durable[0] = 1
        except OSError:
            log.exception("checkpoint %s could not be written", final)
    coll.all_reduce(durable, dist.ReduceOp.MAX, "checkpoint_durable")
    if durable.item() != 1:
        raise RuntimeError(f"checkpoint {final.name} was not made durable by rank 0")
    return final


def _save_shards(
    tmp: Path, model: Any, optimizer: torch.optim.Optimizer, coll: Collectives, export_model: Any | None
) -> Any:
    """Every rank: its shards of model and optimizer into ``tmp/dcp`` and its part of the full state dict, which
    rank 0 loads into ``export_model`` (returned, for the Hugging Face export). Collectives in one order on every
    rank: rank 0 prepares ``tmp``, a barrier, the gather of the full state dict, DCP's save."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from relayrl.trainer.dcp_checkpoint import save_state

    ready = torch.zeros(1)
    if coll.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            ready[0] = 1
        except OSError:
            log.exception("checkpoint folder %s could not be prepared", tmp)
    coll.broadcast(ready, 0, "checkpoint_tmp_ready")
    if ready.item() != 1:
        raise RuntimeError(f"checkpoint folder {tmp} could not be prepared by rank 0")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    save_state(tmp / "dcp", model, optimizer)
    if coll.rank != 0:
        return None
    assert export_model is not None, "rank 0 of a sharded trainer needs an unsharded model to export"
    export_model.load_state_dict(full, strict=False)
    return export_model


def _write(
    root: Path,
    final: Path,
    parts: list[dict[str, Any]],
    step: int,
    weight_version: int,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None,
    keep: int,
    extra: dict[str, Any],
    world_size: int,
) -> None:
    tmp = root / f"{final.name}.tmp"
    root.mkdir(parents=True, exist_ok=True)
    if optimizer is not None:  # sharded: rank 0 prepared tmp and every rank wrote its shards into it already
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    for rank, data in enumerate(parts):
        torch.save(data, tmp / f"rank{rank}.pt")
    model.save_pretrained(str(tmp / "model"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "model"))
    torch.save(
        {
            "step": step,
            "weight_version": weight_version,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "world_size": world_size,
            "extra": extra,
        },
        tmp / STATE_FILE,
    )
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("saved checkpoint %s", final)


def check_shared_folder(root: Path, coll: Collectives, dp_shard: int) -> None:
    """A sharded trainer's ranks write their shards into one checkpoint folder and read each other's on a resume:
    refuse to start when a rank does not see the folder rank 0 writes (trainer pods with volumes of their own),
    before any checkpoint is taken. Collective over ``coll``'s ranks; every rank raises the same ConfigError."""
    token = secrets.token_hex(8) if coll.rank == 0 else None
    if coll.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            (root / f".shared-{token}").write_text(str(token))
        except OSError:
            log.exception("checkpoint folder %s could not be written", root)
    token, written = coll.broadcast_object((token, str(root)), 0, "checkpoint_folder_token")  # after rank 0's write
    marker = root / f".shared-{token}"
    seen = marker.is_file() and marker.read_text() == token
    blind = [r for r, ok in enumerate(coll.all_gather_object(seen, "checkpoint_folder_seen")) if not ok]
    if coll.rank == 0:
        marker.unlink(missing_ok=True)
    if blind:
        raise ConfigError(
            "trainer.distributed.dp_shard",
            dp_shard,
            f"needs one checkpoint folder shared by every rank, but rank(s) {', '.join(map(str, blind))} do not see "
            f"the folder rank 0 writes ({written}): mount one folder on every trainer pod (Helm: "
            "trainer.persistence.shared or existingClaim of a ReadWriteMany claim), or set dp_shard to 1",
        )


def resume_point(root: Path, coll: Collectives) -> Path | None:
    """The newest complete checkpoint as rank 0 sees it, agreed by every rank."""
    found = latest_checkpoint(root) if coll.rank == 0 else None
    name = coll.broadcast_object(found.name if found is not None else None, 0, "resume_point")
    return root / name if name is not None else None


def load_trainer_state(path: Path, optimizer: torch.optim.Optimizer, coll: Collectives) -> CheckpointState:
    """Rank 0 reads the checkpoint and sends every rank the optimizer state, its own RNG state and the consumed
    ids (the union over every rank's part: a rank of a smaller world also reads the groups of ranks that are
    gone, whose entries rank 0 claims). Collective over ``coll``'s ranks."""
    payload: dict[str, Any] | None = None
    rngs: list[Any] = []
    if coll.rank == 0:
        # weights_only: a checkpoint is data; unpickling arbitrary objects from it could run code
        state = torch.load(path / STATE_FILE, weights_only=True)
        consumed: set[str] = set()
        by_rank: dict[int, Any] = {}
        for part in sorted(path.glob("rank*.pt")):
            data = torch.load(part, weights_only=True)
            consumed.update(data["consumed_ids"])
            by_rank[int(part.stem.removeprefix("rank"))] = data["rng"]
        rngs = [by_rank.get(r) for r in range(coll.world_size)]
        payload = {
            "step": int(state["step"]),
            "weight_version": int(state["weight_version"]),
            "extra": dict(state.get("extra", {})),
            "consumed": consumed,
            "optimizer": state["optimizer"],
        }
    payload = coll.broadcast_object(payload, 0, "resume_state")
    rng = coll.broadcast_object(rngs, 0, "resume_rng")[coll.rank]
    assert payload is not None
    if payload["optimizer"] is not None:  # None: a sharded checkpoint, whose optimizer state is in dcp/
        optimizer.load_state_dict(payload["optimizer"])
    if rng is not None:  # None: this rank did not exist when the checkpoint was taken
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    return CheckpointState(
        step=payload["step"],
        weight_version=payload["weight_version"],
        extra=payload["extra"],
        consumed_ids=payload["consumed"],
    )
