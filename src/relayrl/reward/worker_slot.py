"""One verifier worker as the pool sees it (relayrl.reward.pool): its process, pipe, current job and the shared
memory where the worker writes which request it is on; and the process-level operations: start a verifier
process, kill one with its whole process group."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from relayrl.config.reward import SandboxConfig
from relayrl.reward.protocol import Job, Outcome
from relayrl.reward.scorer import ScorerSpec
from relayrl.reward.verifier_process import INDEX, JOB, START, verifier_main


@dataclass
class Item:
    inp: Job
    future: asyncio.Future[Outcome]


@dataclass
class WorkerSlot:
    slot: int
    process: Any = None  # multiprocessing.process.BaseProcess
    conn: Connection | None = None
    ready: bool = False
    job_id: int = 0
    job: list[Item] | None = None
    received: int = 0  # results of the current job received so far
    sent_at: float = 0.0
    progress: Any = None  # shared (start time, index, job id) of the request the worker is on
    timer: asyncio.TimerHandle | None = None
    started_at: float = field(default_factory=time.monotonic)

    def current(self) -> tuple[int, float]:
        """(index, start time) of the request the worker is on, from shared memory; before it started the job:
        the first request without a result, since the job was sent."""
        if (
            self.progress is not None
            and int(self.progress[JOB]) == self.job_id
            and int(self.progress[INDEX]) >= self.received
        ):
            return int(self.progress[INDEX]), float(self.progress[START])
        return self.received, self.sent_at


def spawn_verifier(ctx: Any, spec: ScorerSpec, sandbox: SandboxConfig, memory_mb: int) -> tuple[Any, Connection, Any]:
    """Start a verifier process (multiprocessing context ``ctx``): (process, the pool's end of its pipe, its
    shared progress array)."""
    parent, child = ctx.Pipe(duplex=True)
    progress = ctx.RawArray("d", 3)
    process = ctx.Process(
        target=verifier_main, args=(child, progress, spec, sandbox, memory_mb), daemon=True, name="relayrl-verifier"
    )
    process.start()
    child.close()
    return process, parent, progress


def kill_worker(process: Any) -> None:
    """SIGKILL a verifier process and its own process group (it called setpgrp)."""
    pid = process.pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the worker's own process group (it called setpgrp)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
