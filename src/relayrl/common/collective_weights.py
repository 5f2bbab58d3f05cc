"""Weights by ``torch.distributed`` broadcast: the ``collective`` transport, both ends.

One publication, one group. The sender (the trainer's publishing rank) hosts a TCPStore (:class:`CollectiveHost`)
and, for each update, opens a :class:`CollectiveSession` under a fresh random group name. Each replica learns that
name only from the manifest of its own UpdateWeights call, which the weights token authenticates (and TLS protects
where it is on): a process outside the run cannot find the group's keys, so it cannot join. Joining has two
phases, so a replica that is down never holds the others up: each receiver sets ``ready/<rank>``; the sender waits
for the invited ranks (up to the session's timeout, or until a replica's call has failed), writes ``members``, and
the sender and those members form the group. The sender then broadcasts every tensor, one at a time, in name order,
as raw bytes (:func:`receive` allocates each from its own model's specs, so no layout travels but a digest of it,
checked before joining). The manifest's checksum covers what arrived, as for every transport; the engine's
served-weights check and the probe follow as usual.

``gloo`` moves CPU tensors; ``nccl`` CUDA tensors (the pattern of vLLM's weight updates and prime-rl's NCCL
broadcast). torch.distributed is imported where it is used: a process that never takes part loads nothing.
"""

from __future__ import annotations

import datetime
import hashlib
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.common.pb.inference_pb2 import CollectiveJoin, WeightManifest
from relayrl.common.weights import TensorSpec, WeightUpdateError, check_checksum, dtype_name

__all__ = [
    "BACKENDS",
    "CollectiveHost",
    "CollectiveSession",
    "layout_digest",
    "receive",
    "receive_update",
    "spec_layout",
]

BACKENDS = ("gloo", "nccl")
_POLL_S = 0.01  # how often the sender looks for ready receivers


def layout_digest(specs: Iterable[tuple[str, str, tuple[int, ...]]]) -> str:
    """SHA-256 over each tensor's name, dtype and shape, in name order: sender and receiver must agree before any
    byte is broadcast (a broadcast of mismatched sizes fails only at its deadline)."""
    h = hashlib.sha256()
    for name, dtype, shape in sorted(specs):
        h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\n".encode())
    return h.hexdigest()


def spec_layout(specs: Mapping[str, TensorSpec]) -> str:
    """:func:`layout_digest` of a model's specs (what a receiver checks the sender's against)."""
    return layout_digest((n, dtype_name(s.dtype), tuple(s.shape)) for n, s in specs.items())


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _group(store: Any, rank: int, size: int, backend: str, timeout_s: float) -> Any:
    """A process group of ``size`` over ``store``, without the default group (each update forms its own)."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, _timeout(timeout_s))
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _timeout(timeout_s)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"collective backend must be one of {BACKENDS}, not {backend!r}")


def _broadcast(group: Any, buf: torch.Tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buf], options).wait()


def _as_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


@dataclass
class CollectiveHost:
    """The sender's TCPStore, listening on ``port`` (0: a free one) of every interface and advertised to receivers
    as ``host`` (the name they dial); started at the first session and kept for the run."""

    host: str
    port: int
    backend: str
    timeout_s: float
    _store: Any = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.store.port}"

    @property
    def store(self) -> Any:
        if self._store is None:
            from torch.distributed import TCPStore

            self._store = TCPStore(
                "0.0.0.0", self.port, is_master=True, wait_for_workers=False, timeout=_timeout(self.timeout_s)
            )
        return self._store

    def session(self, invited: int, device: torch.device) -> CollectiveSession:
        return CollectiveSession(self, invited, device)


class CollectiveSession:
    """One update's group: the join each invited receiver gets, the membership, and the broadcast."""

    def __init__(self, host: CollectiveHost, invited: int, device: torch.device) -> None:
        from torch.distributed import PrefixStore

        self.host, self.invited, self.device = host, invited, device
        self.group = secrets.token_hex(16)
        self.store = PrefixStore(self.group, host.store)
        self.members: list[int] = []

    def join(self, rank: int, layout: str) -> CollectiveJoin:
        return CollectiveJoin(
            store_address=self.host.address,
            group=self.group,
            rank=rank,
            invited=self.invited,
            backend=self.host.backend,
            timeout_s=self.host.timeout_s,
            layout=layout,
        )

    def gather_members(self, failed: Callable[[int], bool], grace_s: Callable[[float], float]) -> list[int]:
        """Wait until every invited rank is ready or its call ``failed``, for the session's timeout at most and,
        once one is ready after ``t`` seconds, ``grace_s(t)`` more; publish the ready ones as ``members`` (they
        form the group; the others are refused when they look). Blocking."""
        started = time.monotonic()
        deadline = started + self.host.timeout_s
        pending = set(range(1, self.invited + 1))
        ready: set[int] = set()
        while pending and time.monotonic() < deadline:
            now_ready = {r for r in pending if self.store.check([f"ready/{r}"])}
            if now_ready and not ready:  # the first: the others get a bounded while more
                deadline = min(deadline, time.monotonic() + grace_s(time.monotonic() - started))
            ready |= now_ready
            pending -= now_ready | {r for r in pending if failed(r)}
            if pending:
                time.sleep(_POLL_S)
        self.members = sorted(ready)
        self.store.set("members", ",".join(map(str, self.members)))
        return self.members

    def broadcast(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Form the group with the members and broadcast each tensor, in name order, one at a time (the bytes of
        one tensor beside the caller's at most). Returns the bytes sent to each member. Blocking."""
        if not self.members:
            return 0
        from torch.distributed import PrefixStore

        group = _group(PrefixStore("pg", self.store), 0, len(self.members) + 1, self.host.backend, self.host.timeout_s)
        sent = 0
        for name in sorted(tensors):
            buf = _as_bytes(tensors[name], self.device)
            _broadcast(group, buf)
            sent += buf.numel()
        return sent


def receive(join: CollectiveJoin, specs: Mapping[str, TensorSpec], device: torch.device) -> dict[str, torch.Tensor]:
    """Receiver: join the update's group and receive a tensor for each of ``specs`` (the served model's), in name
    order. WeightUpdateError when the layouts differ, this receiver is not among the members, or the group fails
    (its timeout included). Blocking: run it off the event loop."""
    from torch.distributed import PrefixStore, TCPStore

    if join.backend not in BACKENDS:
        raise WeightUpdateError(f"unknown collective backend {join.backend!r}")
    if join.layout != spec_layout(specs):
        raise WeightUpdateError("the update's tensors (names, dtypes, shapes) are not this model's")
    host, _, port = join.store_address.rpartition(":")
    try:
        store = PrefixStore(join.group, TCPStore(host, int(port), is_master=False, timeout=_timeout(join.timeout_s)))
        store.set(f"ready/{join.rank}", "1")
        store.wait(["members"], _timeout(join.timeout_s))
        members = [int(r) for r in store.get("members").decode().split(",") if r]
        if join.rank not in members:
            raise WeightUpdateError("joined after the update's group was formed")
        group = _group(
            PrefixStore("pg", store), members.index(join.rank) + 1, len(members) + 1, join.backend, join.timeout_s
        )
        tensors = {}
        for name in sorted(specs):
            spec = specs[name]
            buf = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
            _broadcast(group, buf)
            tensors[name] = buf.view(spec.dtype).view(spec.shape)
    except WeightUpdateError:
        raise
    except (RuntimeError, ValueError) as exc:  # torch.distributed's errors (DistStoreError, gloo's) are RuntimeErrors
        raise WeightUpdateError(f"collective update failed: {exc}") from exc
    return tensors


def receive_update(m: WeightManifest, specs: Mapping[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """Receiver: the tensors of the collective update ``m`` (CPU), checked against the manifest (count, size, then
    the checksum of what arrived) as every transport's are. Blocking."""
    if m.num_tensors != len(specs) or m.total_bytes != sum(s.nbytes for s in specs.values()):
        raise WeightUpdateError(
            f"manifest says {m.num_tensors} tensors of {m.total_bytes} bytes; this model has {len(specs)} tensors "
            f"of {sum(s.nbytes for s in specs.values())} bytes"
        )
    device = torch.device("cuda" if m.collective.backend == "nccl" else "cpu")
    tensors = {name: t.cpu() for name, t in receive(m.collective, specs, device).items()}
    check_checksum(tensors, m)
    return tensors
