"""The verifier worker process: imports the reward once, then scores the inputs the pool sends it.

Protocol over a duplex pipe (pickled tuples): the worker sends ("ready", pid) or ("init_error", message); it
receives ("batch", job_id, [RewardInput, ...]) and sends ("results", job_id, [(index, status, result, error,
seconds), ...]) in order: at the end of the batch, after an input that took FLUSH_S or more, or once results
have waited FLUSH_S (fast verifiers cost one message per batch, slow ones report each result at once);
("stop",) ends it.

Before each input the worker writes (start time on CLOCK_MONOTONIC, index, job id) into ``progress``, shared
memory the pool reads when a deadline passes: it knows which input overran, and since when, without a message.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

from relayrl.config.reward import SandboxConfig
from relayrl.reward.sandbox import Sandbox
from relayrl.reward.scorer import Scorer, ScorerSpec

log = logging.getLogger(__name__)


FLUSH_S = 0.002
START, INDEX, JOB = 0, 1, 2  # slots of the progress array


def worker_main(conn: Connection, progress: Any, spec: ScorerSpec, sandbox_cfg: SandboxConfig,
                memory_mb: int = 0) -> None:
    os.setpgrp()  # the pool kills this process group: the worker and anything a verifier started in it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service shuts the pool down; Ctrl-C is not for us
    try:
        if memory_mb:  # soft limit only: the sandbox may set its own (lower or higher) for the programs it runs
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 1024 * 1024, hard))
        scorer = Scorer(spec, sandbox=Sandbox(sandbox_cfg))
    except BaseException as exc:  # reported to the pool, which fails start-up with it
        conn.send(("init_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the service is gone
        if message[0] == "stop":
            scorer.close()
            return
        _, job_id, inputs = message
        pending: list[tuple[Any, ...]] = []
        waiting_since = 0.0
        for index, inp in enumerate(inputs):
            t0 = time.monotonic()
            progress[START], progress[INDEX], progress[JOB] = t0, index, job_id
            try:
                result = scorer(inp)
                pending.append((index, "ok", result, "", time.monotonic() - t0))
            except BaseException as exc:  # a verifier that raises (even SystemExit) is an error
                pending.append((index, "error", None, f"{type(exc).__name__}: {exc}"[:2000], time.monotonic() - t0))
            now = time.monotonic()
            waiting_since = waiting_since or now
            if index == len(inputs) - 1 or now - t0 >= FLUSH_S or now - waiting_since >= FLUSH_S:
                conn.send(("results", job_id, pending))
                pending, waiting_since = [], 0.0
