"""A pool of verifier processes with a per-call timeout that kills and replaces only the overrunning one.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot kill one worker, and a worker that dies breaks the
whole pool. Here each worker is a process of its own (multiprocessing ``forkserver`` or ``spawn``), talked to over
its own pipe (the typed messages of protocol.py), read by the asyncio loop (``add_reader``). Nothing blocks the
loop: processes start, are joined and reaped in threads (``run_in_executor`` / ``asyncio.to_thread``); the loop
only sends a batch to a worker waiting in ``recv`` and reads messages the worker has written.

Requests queue; an idle worker takes a chunk of up to ``chunk_size`` of them (ceil(queued / workers), so a batch
spreads over the pool) and sends back results as it goes (see verifier_process.py). Before each request the worker
writes its index and start time into shared memory; a timer armed at ``timeout_s`` after the chunk is sent checks it
and re-arms until a request has run past ``timeout_s``. Then the worker's process group is SIGKILLed, that request
is a TIMEOUT result, the requests of the chunk whose results had not arrived go back to the front of the queue
(scored again elsewhere), and a new worker starts in its place. A worker that dies (a verifier calling ``os._exit``,
a segfault) gives an ERROR result for the request it was running, the same requeue and a replacement. Nothing waits
forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import multiprocessing
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from relayrl.config.reward import SandboxConfig
from relayrl.reward.protocol import Batch, InitError, Job, Outcome, Ready, Results, Status, Stop, ToPool
from relayrl.reward.scorer import ScorerSpec
from relayrl.reward.worker_slot import Item, WorkerSlot, kill_worker, spawn_verifier

log = logging.getLogger(__name__)


class PoolStartError(RuntimeError):
    """The workers could not start (the reward function fails to import in them)."""


class VerifierPool:
    def __init__(
        self,
        spec: ScorerSpec,
        sandbox: SandboxConfig,
        size: int,
        timeout_s: float,
        chunk_size: int = 32,
        start_method: str = "forkserver",
        memory_mb: int = 0,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self.memory_mb = memory_mb
        self.spec = spec
        self.sandbox = sandbox
        self.size = size
        self.timeout_s = timeout_s
        self.chunk_size = chunk_size
        self.on_restart = on_restart
        self._ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # replacements fork from a server that has these imported already (no import cost after a kill)
            self._ctx.set_forkserver_preload(["relayrl.reward.verifier_process", *spec.modules()])  # type: ignore[attr-defined]
        self._workers = [WorkerSlot(slot=i) for i in range(size)]
        self._queue: deque[Item] = deque()
        self._jobs = itertools.count(1)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._init_error: str | None = None
        self._ready_changed = asyncio.Event()
        self._closed = False
        self._started = False
        self.restarts: dict[str, int] = {"timeout": 0, "crash": 0}

    # -- status ----------------------------------------------------------------------------------------------
    @property
    def ready_workers(self) -> int:
        return sum(w.ready for w in self._workers)

    @property
    def busy_workers(self) -> int:
        return sum(w.job is not None for w in self._workers)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process is not None and w.process.pid is not None]

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 120.0) -> None:
        """Start every worker and wait until all are ready; PoolStartError if the reward fails to load in them."""
        self._loop = asyncio.get_running_loop()
        await asyncio.gather(*(self._start_worker(w) for w in self._workers))
        deadline = time.monotonic() + timeout_s
        while self.ready_workers < self.size:
            if self._init_error is not None:
                await self.close()
                raise PoolStartError(f"verifier workers failed to start: {self._init_error}")
            left = deadline - time.monotonic()
            if left <= 0:
                await self.close()
                raise PoolStartError(
                    f"only {self.ready_workers} of {self.size} verifier workers ready after {timeout_s:.0f}s"
                )
            self._ready_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready_changed.wait(), timeout=min(left, 1.0))
        self._started = True
        log.info("%d verifier workers ready (%s)", self.size, self.spec.describe())

    async def _start_worker(self, w: WorkerSlot, delay_s: float = 0.0) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)
        loop = asyncio.get_running_loop()
        process, conn, progress = await loop.run_in_executor(
            None, spawn_verifier, self._ctx, self.spec, self.sandbox, self.memory_mb
        )
        if self._closed:
            kill_worker(process)
            conn.close()
            return
        w.process, w.conn, w.progress, w.ready, w.job = process, conn, progress, False, None
        w.started_at = time.monotonic()
        loop.add_reader(conn.fileno(), self._on_readable, w, conn)

    async def close(self) -> None:
        """Stop the workers (politely, then SIGKILL) and fail what is still queued."""
        self._closed = True
        for item in self._queue:
            if not item.future.done():
                item.future.set_result(Outcome(Status.ERROR, error="the reward service is shutting down"))
        self._queue.clear()
        processes = []
        for w in self._workers:
            if w.conn is not None:
                self._detach(w)
                with contextlib.suppress(OSError):
                    w.conn.send(Stop())
                w.conn.close()
                w.conn = None
            if w.job is not None:
                for item in w.job[w.received :]:
                    if not item.future.done():
                        item.future.set_result(Outcome(Status.ERROR, error="the reward service is shutting down"))
                w.job = None
            if w.process is not None:
                processes.append(w.process)
            w.ready = False
        for task in list(self._tasks):
            task.cancel()

        def join_all() -> None:
            for p in processes:
                p.join(2.0)
                if p.is_alive():
                    kill_worker(p)
                    p.join(2.0)

        await asyncio.get_running_loop().run_in_executor(None, join_all)

    # -- scoring ---------------------------------------------------------------------------------------------
    async def score_many(self, inputs: Sequence[Job]) -> list[Outcome]:
        """One Outcome per input (a completion to score or a program to run), in order. Inputs are spread over the
        workers and handled in parallel."""
        if self._closed:
            return [Outcome(Status.ERROR, error="the reward service is shutting down") for _ in inputs]
        loop = asyncio.get_running_loop()
        items = [Item(inp, loop.create_future()) for inp in inputs]
        self._queue.extend(items)
        self._dispatch()
        try:
            return list(await asyncio.gather(*(i.future for i in items)))
        except asyncio.CancelledError:
            for item in items:
                item.future.cancel()
            raise

    def _dispatch(self) -> None:
        if self._closed:
            return
        idle = [w for w in self._workers if w.ready and w.job is None]
        while self._queue and idle:
            n = min(self.chunk_size, max(1, math.ceil(len(self._queue) / self.size)))
            items: list[Item] = []
            while self._queue and len(items) < n:
                item = self._queue.popleft()
                if not item.future.done():  # a cancelled call's requests are not scored
                    items.append(item)
            if not items:
                break
            w = idle.pop()
            assert w.conn is not None
            w.job_id, w.job, w.received, w.sent_at = next(self._jobs), items, 0, time.monotonic()
            try:  # an idle worker waits in recv(): the send returns as soon as it has read the batch
                w.conn.send(Batch(w.job_id, tuple(i.inp for i in items)))
            except (OSError, ValueError):  # the worker died just now: its EOF handler has not run yet
                self._queue.extendleft(reversed(items))
                w.job = None
                self._replace(w, "crash")
                continue
            self._arm(w, self.timeout_s)

    def _arm(self, w: WorkerSlot, delay_s: float) -> None:
        assert self._loop is not None
        if w.timer is not None:
            w.timer.cancel()
        w.timer = self._loop.call_later(delay_s, self._on_deadline, w, w.job_id)

    # -- events from workers ---------------------------------------------------------------------------------
    def _on_readable(self, w: WorkerSlot, conn: Connection) -> None:
        if w.conn is not conn:
            return
        try:
            while conn.poll():
                self._handle(w, conn.recv())
                if w.conn is not conn:
                    return
        except (EOFError, OSError):
            self._on_death(w, conn)

    def _handle(self, w: WorkerSlot, message: ToPool) -> None:
        if isinstance(message, Ready):
            w.ready = True
            self._ready_changed.set()
            self._dispatch()
        elif isinstance(message, InitError):
            self._init_error = message.message
            self._ready_changed.set()  # start() reports it
            log.error("verifier process failed to start: %s", message.message)
        elif isinstance(message, Results):
            self._on_results(w, message)

    def _on_results(self, w: WorkerSlot, message: Results) -> None:
        if message.job_id != w.job_id or w.job is None:
            return
        for scored in message.scored:
            if scored.index != w.received:
                continue
            item = w.job[scored.index]
            if not item.future.done():
                item.future.set_result(scored.outcome)
            w.received += 1
        if w.received == len(w.job):
            w.job = None
            if w.timer is not None:
                w.timer.cancel()
                w.timer = None
            self._dispatch()

    def _on_deadline(self, w: WorkerSlot, job_id: int) -> None:
        if w.job is None or w.job_id != job_id:
            return
        index, started = w.current()
        overrun = time.monotonic() - started
        if overrun < self.timeout_s:  # the request running now started later: wait for its own deadline
            self._arm(w, self.timeout_s - overrun)
            return
        item = w.job[index]
        if not item.future.done():
            item.future.set_result(
                Outcome(
                    Status.TIMEOUT,
                    error=f"verifier did not finish within {self.timeout_s:g}s; its worker process was "
                    "killed and replaced",
                    seconds=overrun,
                )
            )
        self._requeue_rest(w, index)
        log.warning(
            "verifier timed out after %.1fs: killing worker pid %s", self.timeout_s, getattr(w.process, "pid", None)
        )
        self._replace(w, "timeout")

    def _on_death(self, w: WorkerSlot, conn: Connection) -> None:
        """EOF on a worker's pipe: it died. Its exit status is read in a thread (the process may not be reaped
        yet), then its request fails and it is replaced; meanwhile it takes no work and no deadline fires."""
        if w.conn is not conn or self._closed:
            return
        self._detach(w)
        was_ready, w.ready = w.ready, False
        self._track(asyncio.ensure_future(self._after_death(w, conn, was_ready)))

    async def _after_death(self, w: WorkerSlot, conn: Connection, was_ready: bool) -> None:
        process = w.process
        if process is not None:
            await asyncio.to_thread(process.join, 0.5)
        if w.conn is not conn or self._closed:  # close() failed its requests meanwhile
            return
        code = getattr(process, "exitcode", None)
        why = (
            f"killed by signal {signal.Signals(-code).name}"
            if isinstance(code, int) and code < 0
            else f"exit code {code}"
        )
        if w.job is not None:
            index, _ = w.current()
            item = w.job[index]
            if not item.future.done():
                item.future.set_result(Outcome(Status.ERROR, error=f"verifier worker process died ({why})"))
            self._requeue_rest(w, index)
        if not was_ready:
            if self._init_error is None:
                self._init_error = f"a worker died while starting ({why})"
                self._ready_changed.set()
            if not self._started:
                return  # start() reports it (and closes the pool)
        log.warning("verifier process pid %s died (%s); replacing it", getattr(process, "pid", None), why)
        self._replace(w, "crash", restart_delay_s=0.0 if was_ready else 1.0)

    def _requeue_rest(self, w: WorkerSlot, failed: int) -> None:
        """Requeue the job's requests without a result but the one at ``failed``: those after it, and those
        before it whose results were lost with the worker."""
        if w.job is not None:
            self._queue.extendleft(reversed(w.job[w.received : failed] + w.job[failed + 1 :]))
            w.job = None

    # -- replacing a worker ----------------------------------------------------------------------------------
    def _detach(self, w: WorkerSlot) -> None:
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None
        if w.conn is not None and self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(w.conn.fileno())

    def _replace(self, w: WorkerSlot, reason: str, restart_delay_s: float | None = None) -> None:
        """Kill ``w``'s process and start another in its slot (after ``restart_delay_s``; by default none if it
        was ready, else a pause: a worker that dies before it is ready is not restarted in a tight loop)."""
        self._detach(w)
        old = w.process
        if old is not None:
            kill_worker(old)
        if w.conn is not None:
            w.conn.close()
        if restart_delay_s is None:
            restart_delay_s = 0.0 if w.ready else 1.0
        w.conn, w.process, w.ready, w.job = None, None, False, None
        self.restarts[reason] = self.restarts.get(reason, 0) + 1
        if self.on_restart is not None:
            self.on_restart(reason)
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        if old is not None:  # reap it without blocking the loop
            self._track(loop.run_in_executor(None, old.join, 5.0))
        self._track(asyncio.ensure_future(self._start_worker(w, restart_delay_s)))

    def _track(self, fut: asyncio.Future[Any]) -> None:
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)
