"""The verifier worker process: imports the reward once, then scores the inputs the pool sends it.

Protocol over a duplex pipe (pickled tuples): the worker sends ("ready", pid) or ("init_error", message); it
receives ("batch", job_id, [RewardInput, ...]) and sends ("result", job_id, index, status, result, error,
seconds) for each input as soon as it is scored, in order; ("stop",) ends it. The pool derives when each input
started from these messages, so a per-input timeout needs no clock shared with the worker.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import time
from multiprocessing.connection import Connection

from relayrl.reward import sandbox
from relayrl.reward.sandbox import SandboxConfig
from relayrl.reward.scorer import Scorer, ScorerSpec

log = logging.getLogger(__name__)


def worker_main(conn: Connection, spec: ScorerSpec, sandbox_cfg: SandboxConfig, memory_mb: int = 0) -> None:
    os.setpgrp()  # the pool kills this process group: the worker and anything a verifier started in it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service shuts the pool down; Ctrl-C is not for us
    try:
        if memory_mb:
            resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 1024 * 1024, memory_mb * 1024 * 1024))
        sandbox.configure(sandbox_cfg)
        scorer = Scorer(spec)
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
        for index, inp in enumerate(inputs):
            t0 = time.perf_counter()
            try:
                result = scorer(inp)
                reply = ("result", job_id, index, "ok", result, "", time.perf_counter() - t0)
            except BaseException as exc:  # a verifier that raises (even SystemExit) is an error
                reply = ("result", job_id, index, "error", None, f"{type(exc).__name__}: {exc}"[:2000],
                         time.perf_counter() - t0)
            conn.send(reply)
