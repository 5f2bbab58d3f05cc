"""Borrowing generation's cores while inference is idle (``trainer.threads.borrow_cpus``).

On one machine the local launcher gives inference some cores and the trainer the others, so that a step never
shares its core with generation. But generation stops whenever rollout has filled the staleness window (until the
trainer publishes the next version), and then its cores idle while the trainer computes. :class:`CoreLoan` lets
the trainer use them meanwhile: :func:`watch_inference_idle` asks inference for its status every ``borrow_poll_s``
and marks the cores wanted while no request runs or waits; the compute thread applies the change at the next
decoder layer, in the forward or the backward pass (:meth:`CoreLoan.hook`): it pins the process to its own and the
borrowed cores and raises torch's intra-op threads by one per borrowed core, or back. torch's thread count is per
OS thread under OpenMP, so only the thread that computes may change it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from relayrl.common.threads import pin_cpus
from relayrl.config.threads import TrainerThreadsConfig

log = logging.getLogger(__name__)


class CoreLoan:
    """Whether the trainer runs on its own cores or also on borrowed ones, changed only in the computing thread."""

    def __init__(self, own: Sequence[int], borrowed: Sequence[int], threads: int) -> None:
        self.own, self.wide = sorted(own), sorted({*own, *borrowed})
        self.threads, self.wide_threads = threads, threads + len(borrowed)
        self.wanted = False  # set by the watcher (the event loop's thread)
        self.held = False  # what the computing thread applied
        self.borrows = 0  # times the cores were borrowed
        self.borrowed_s = 0.0  # seconds they were held, up to the last return (held_s: up to now)
        self._since = 0.0
        self._lock = threading.Lock()  # several threads may compute (a step, the publication's probe)
        self._local = threading.local()  # the intra-op count set in each thread

    @classmethod
    def of(cls, cfg: TrainerThreadsConfig) -> CoreLoan | None:
        return cls(cfg.cpus, cfg.borrow_cpus, cfg.intra_op) if cfg.borrow_cpus else None

    def held_s(self) -> float:
        """Seconds the borrowed cores were held, a loan still running included."""
        return self.borrowed_s + (time.monotonic() - self._since if self.held else 0.0)

    def want(self, wide: bool) -> None:
        self.wanted = wide

    def apply(self) -> None:
        """In the computing thread: take or give back the borrowed cores if the watcher changed its mind, and hold
        this thread's intra-op count to match (it is per thread: the step may run on another executor thread)."""
        wide = self.wanted
        if wide != self.held:
            with self._lock:
                if wide != self.held:
                    self._pin(wide)
        threads = self.wide_threads if self.held else self.threads
        if getattr(self._local, "threads", None) != threads:
            torch.set_num_threads(threads)
            self._local.threads = threads

    def _pin(self, wide: bool) -> None:
        pin_cpus(self.wide if wide else self.own, "trainer.threads.borrow_cpus", check=False)
        now = time.monotonic()
        if wide:
            self.borrows += 1
            self._since = now
        else:
            self.borrowed_s += now - self._since
        self.held = wide

    def hook(self, model: torch.nn.Module) -> int:
        """Apply at the start of every decoder layer's forward and of its backward; returns the layers hooked. A
        model without an ``nn.ModuleList`` of layers is hooked as one layer (it switches per micro-batch)."""
        found = next((m for name, m in model.named_modules() if name.endswith("layers")), None)
        layers = found if isinstance(found, torch.nn.ModuleList) else [model]
        for layer in layers:
            layer.register_forward_pre_hook(self._before_forward)
            layer.register_forward_hook(self._after_forward)
        return len(layers)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.apply()

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._before_backward)  # runs when this layer's backward is about to start

    def _before_backward(self, grad: torch.Tensor) -> None:
        self.apply()


async def watch_inference_idle(
    loan: CoreLoan,
    status: Callable[[], Any],
    poll_s: float,
    stopped: Callable[[], bool],
    worth_it: Callable[[], bool] = lambda: True,
) -> None:
    """Rank 0: every ``poll_s``, while borrowing is ``worth_it`` (the last step computed long enough), ask inference
    (``status``: its GetStatus) whether a request runs or waits; idle means borrow. An unreachable or failing
    inference is not idle (the cores stay with generation)."""
    while not stopped():
        if not worth_it():
            loan.want(False)
            await asyncio.sleep(poll_s)
            continue
        try:
            st = await status()
            idle = st.requests_running == 0 and st.requests_queued == 0
        except Exception as exc:  # an unreachable inference must not stop training; it only keeps the cores apart
            log.debug("inference status for core borrowing failed: %s", exc)
            idle = False
        if idle != loan.wanted:
            log.debug(
                "inference %s: trainer %s CPUs %s",
                "idle" if idle else "busy",
                "takes" if idle else "returns",
                loan.wide,
            )
        loan.want(idle)
        await asyncio.sleep(poll_s)
    loan.want(False)
