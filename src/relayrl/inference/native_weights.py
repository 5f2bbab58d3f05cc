"""The native engine's weight bookkeeping: a pending weight swap, every module path each parameter is read through,
and the check after a swap that each of those paths reads the update's tensor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

ModulePaths = dict[str, list[tuple[Any, str, str]]]  # parameter name -> (module, attribute, path) of each path


@dataclass
class Swap:
    tensors: Mapping[str, torch.Tensor]
    version: int
    probe: Sequence[Sequence[int]]
    done: Future[list[float]] = field(default_factory=Future)


def module_paths(model: Any, params: Mapping[str, Any]) -> ModulePaths:
    """The module paths of each of ``params`` (the model's named parameters), resolved to their modules."""
    # every module path of each parameter (a tied output layer is a second path of the embedding)
    paths: dict[int, list[str]] = {}
    for path, param in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(param), []).append(path)
    # (module, attribute) of each path, resolved once: the check after a swap reads the attribute the forward reads
    return {name: [_owner(model, path) for path in paths[id(p)]] for name, p in params.items()}


def served_mismatch(paths: ModulePaths, tensors: Mapping[str, torch.Tensor]) -> str:
    """The first module path of an updated parameter whose tensor is not the update's (same storage, shape,
    strides and dtype: the bytes the server checksummed), or "" when every path reads the update. No pass
    over the data: the swap is by reference, so identity proves content."""
    for name, t in tensors.items():
        for module, attr, path in paths[name]:
            served = getattr(module, attr)
            if not (
                served.data_ptr() == t.data_ptr()
                and served.shape == t.shape
                and served.stride() == t.stride()
                and served.dtype == t.dtype
            ):
                return path
    return ""


def _owner(model: Any, path: str) -> tuple[Any, str, str]:
    """The module holding the parameter at ``path``, its attribute name, and the path."""
    module_path, _, attr = path.rpartition(".")
    return model.get_submodule(module_path), attr, path
