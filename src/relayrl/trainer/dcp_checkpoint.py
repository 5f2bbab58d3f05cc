"""Model and optimizer state saved and loaded with ``torch.distributed.checkpoint`` (DCP): each rank writes its
own shards, and a checkpoint loads onto any number of ranks and any sharding (2 ranks -> 1 -> 2 tested), with no
rank ever holding the whole state. Without a process group (one rank) it runs in-process.

relayrl.trainer.checkpoint writes a sharded (FSDP2) model's checkpoint with :func:`save_state` under ``dcp/``, beside
the Hugging Face export of the full model; every rank of a resume restores it with :func:`load_state`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def save_state(path: Path, model: Any, optimizer: Any | None = None) -> None:
    """Every rank calls it with its (possibly FSDP2-sharded) model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
    dcp.save(state, checkpoint_id=str(path), no_dist=_no_dist())


def load_state(path: Path, model: Any, optimizer: Any | None = None) -> None:
    """Every rank calls it; each reads the parts of the saved tensors its own shards cover."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(path), no_dist=_no_dist())
        set_model_state_dict(model, state["model"])
        return
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path), no_dist=_no_dist())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
