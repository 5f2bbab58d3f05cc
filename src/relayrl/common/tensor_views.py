"""Views over tensors that share one CPU storage (a snapshot packed into one buffer, a file read at once).

An adapter update is hundreds of small tensors: per-tensor tensor operations (six of them to get one tensor's
bytes, one reduction per tensor for the finite check) cost more than the work on their bytes. These helpers do that
work per storage instead, with cheap Python slicing or one strided view per run of adjacent tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The contiguous bytes of one tensor (copied to the CPU and made contiguous when it is not already)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def byte_views(tensors: Mapping[str, torch.Tensor]) -> dict[str, memoryview]:
    """The contiguous bytes of each tensor, as :func:`tensor_bytes`; tensors that live in one CPU storage (a
    snapshot, a file read at once) are cut out of a single view of it: a handful of tensor operations in all rather
    than six per tensor, which for an adapter's hundreds of small tensors cost more than hashing their bytes."""
    storages: dict[int, memoryview] = {}
    out: dict[str, memoryview] = {}
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            out[name] = tensor_bytes(t)
            continue
        storage = t.untyped_storage()
        whole = storages.get(storage.data_ptr())
        if whole is None:
            array: Any = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
            whole = storages[storage.data_ptr()] = memoryview(array).cast("B")
        start = t.storage_offset() * t.element_size()
        out[name] = whole[start : start + t.numel() * t.element_size()]
    return out


def spans(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors joined, where they are contiguous and adjacent in the same storage with the same dtype, into
    flat views that cover exactly their elements (each span is one tensor op to check instead of many)."""
    groups: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
    out: list[torch.Tensor] = []
    for t in tensors:
        if not t.is_contiguous():
            out.append(t)  # checked alone
        elif t.numel():
            groups.setdefault((t.untyped_storage().data_ptr(), t.dtype, t.device), []).append(t)
    for group in groups.values():
        group.sort(key=lambda t: t.storage_offset())
        first = group[0]
        start = end = first.storage_offset()
        for t in group:
            if t.storage_offset() > end:  # a gap: close the span, start another
                out.append(first.as_strided((end - start,), (1,), start))
                first, start = t, t.storage_offset()
            end = max(end, t.storage_offset() + t.numel())
        out.append(first.as_strided((end - start,), (1,), start))
    return out


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def packed_copy(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` (detached, contiguous), packed back to back in name order into one buffer per dtype and
    device: what a clone per tensor gives, in one copy operation per buffer; readers of the copy (the shared-memory
    writer, the checksum) then see one storage."""
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name in sorted(tensors):
        groups.setdefault((tensors[name].dtype, tensors[name].device), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for (dtype, device), names in groups.items():
        buf = torch.empty(sum(tensors[n].numel() for n in names), dtype=dtype, device=device)
        at = 0
        for name in names:
            shape = tuple(tensors[name].shape)
            out[name] = buf.as_strided(shape, contiguous_strides(shape), at)
            at += tensors[name].numel()
        with torch.no_grad():
            torch._foreach_copy_([out[n] for n in names], [tensors[n].detach() for n in names])
    return {name: out[name] for name in sorted(tensors)}
