"""Every collective the trainer runs goes through :class:`Collectives`: explicit group, timeout, recording.

- The process group is passed in (never created at import time); rank and world size come from it.
- Each call runs asynchronously and waits with a timeout, so a dead or diverged rank turns into a
  :class:`CollectiveTimeout` naming the collective, never a hang.
- With ``record_dir`` set (debug mode), every rank appends one JSON line per collective to
  ``<record_dir>/rank<R>.jsonl``: index, op, name, group, shapes, dtypes, reduce op, source rank.
  ``relayrl debug collectives RUN_DIR`` compares the ranks' sequences and names the first divergence.
- With no group (a single process), collectives are identities (still recorded), so the same trainer code
  runs with 1 rank and with N.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

T = TypeVar("T")


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the timeout: a rank died, hangs or called something else."""


class Collectives:
    def __init__(
        self,
        group: dist.ProcessGroup | None,
        timeout_s: float,
        record_dir: Path | None = None,
        group_name: str = "default",
    ) -> None:
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)
        self.group_name = group_name
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.index = 0
        self._record: IO[str] | None = None
        if record_dir is not None:
            record_dir.mkdir(parents=True, exist_ok=True)
            self._record = (record_dir / f"rank{self.rank}.jsonl").open("w")

    def close(self) -> None:
        if self._record is not None:
            self._record.close()
            self._record = None

    def _log(
        self, op: str, name: str, tensors: list[torch.Tensor], reduce_op: str | None = None, src: int | None = None
    ) -> None:
        if self._record is not None:
            self._record.write(
                json.dumps(
                    {
                        "index": self.index,
                        "op": op,
                        "name": name,
                        "group": self.group_name,
                        "world_size": self.world_size,
                        "shapes": [list(t.shape) for t in tensors],
                        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                        "reduce_op": reduce_op,
                        "src": src,
                    }
                )
                + "\n"
            )
            self._record.flush()
        self.index += 1

    def _wait(self, work: Any, op: str, name: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise CollectiveTimeout(
                f"rank {self.rank}: collective #{self.index - 1} {op}({name}) did not complete within "
                f"{self.timeout.total_seconds():.0f}s; another rank died, hangs or diverged ({exc})"
            ) from exc

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` (blocking: it calls collectives) from the event loop: in a worker thread when ranks
        communicate, so that waiting for the others never blocks the loop; inline in a single process, where
        every collective is an identity and a thread would only add its hand-offs to the step."""
        if self.group is None:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, name: str) -> torch.Tensor:
        """In-place all-reduce; ``op`` is chosen by the caller (SUM or MAX, never implicit)."""
        self._log("all_reduce", name, [tensor], reduce_op=str(op).rsplit(".", 1)[-1])
        if self.group is not None:
            self._wait(dist.all_reduce(tensor, op=op, group=self.group, async_op=True), "all_reduce", name)
        return tensor

    def all_reduce_coalesced(self, tensors: list[torch.Tensor], op: dist.ReduceOp.RedOpType, name: str) -> None:
        """All-reduce several tensors as one flat buffer (one collective), results written back in place."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.all_reduce(flat, op, name)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def broadcast(self, tensor: torch.Tensor, src: int, name: str) -> torch.Tensor:
        """In-place broadcast from the named source rank."""
        self._log("broadcast", name, [tensor], src=src)
        if self.group is not None:
            self._wait(dist.broadcast(tensor, src=src, group=self.group, async_op=True), "broadcast", name)
        return tensor

    def all_gather(self, tensor: torch.Tensor, name: str) -> list[torch.Tensor]:
        """Every rank's copy of a same-shaped tensor, in rank order."""
        self._log("all_gather", name, [tensor])
        if self.group is None:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._wait(dist.all_gather(out, tensor, group=self.group, async_op=True), "all_gather", name)
        return out

    def broadcast_object(self, obj: Any, src: int, name: str) -> Any:
        """A picklable object from ``src`` to every rank (two timed broadcasts: size, then bytes)."""
        if self.group is None:
            return obj
        data = pickle.dumps(obj) if self.rank == src else b""
        size = self.broadcast(torch.tensor([len(data)], dtype=torch.int64), src, f"{name}/size")
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == src
            else torch.empty(int(size[0]), dtype=torch.uint8)
        )
        self.broadcast(buf, src, f"{name}/bytes")
        return obj if self.rank == src else pickle.loads(buf.numpy().tobytes())

    def all_gather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's picklable object, in rank order (sizes gathered first, bytes padded to the largest)."""
        if self.group is None:
            return [obj]
        data = pickle.dumps(obj)
        sizes = [int(t[0]) for t in self.all_gather(torch.tensor([len(data)], dtype=torch.int64), f"{name}/size")]
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = self.all_gather(buf, f"{name}/bytes")
        return [pickle.loads(p[:n].numpy().tobytes()) for p, n in zip(parts, sizes, strict=True)]

    def barrier_for_debug(self, name: str) -> None:
        """Only for debugging: synchronises all ranks."""
        self._log("barrier", name, [])
        if self.group is not None:
            self._wait(dist.barrier(group=self.group, async_op=True), "barrier", name)

    def broadcast_coalesced(self, tensors: list[torch.Tensor], src: int, name: str) -> None:
        """Broadcast several tensors from ``src`` as one flat buffer (one collective), written back in place."""
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        self.broadcast(flat, src, name)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
