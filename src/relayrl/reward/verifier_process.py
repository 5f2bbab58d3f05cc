"""The verifier process: imports the reward once, then scores the inputs the pool sends it.

It talks to the pool over a duplex pipe with the messages of protocol.py: it sends :class:`Ready` (or
:class:`InitError`), then for each :class:`Batch` it receives sends :class:`Results` in order: at the end of the
batch, after an input that took FLUSH_S or more, or once results have waited FLUSH_S (fast verifiers cost one
message per batch, slow ones report each result at once); :class:`Stop` ends it.

Before each input the process writes (start time on CLOCK_MONOTONIC, index, job id) into ``progress``, shared
memory the pool reads when a deadline passes: it knows which input overran, and since when, without a message.

The process builds the :class:`~relayrl.reward.sandbox.Sandbox` of the configured SandboxConfig and gives it to
the scorer, which passes it to the verifiers that take a ``sandbox`` keyword (the ``code`` verifier); a
:class:`~relayrl.reward.protocol.CodeRun` job (RunCode) runs its program in the same sandbox. A batched reward
(:func:`relayrl.reward.api.batched`: a judge model, a reward model) gets the whole batch in one call.
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
from relayrl.reward.protocol import Batch, CodeRun, InitError, Outcome, Ready, Results, Scored, Status, Stop
from relayrl.reward.sandbox import Sandbox, SandboxUnavailable
from relayrl.reward.scorer import Scorer, ScorerSpec

log = logging.getLogger(__name__)


FLUSH_S = 0.002
START, INDEX, JOB = 0, 1, 2  # slots of the progress array


def verifier_main(
    conn: Connection, progress: Any, spec: ScorerSpec, sandbox_cfg: SandboxConfig, memory_mb: int = 0
) -> None:
    os.setpgrp()  # the pool kills this process group: the verifier and anything a verifier started in it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service shuts the pool down; Ctrl-C is not for us
    try:
        if memory_mb:  # soft limit only: the sandbox may set its own (lower or higher) for the programs it runs
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 1024 * 1024, hard))
        scorer = Scorer(spec, sandbox=Sandbox(sandbox_cfg))
    except BaseException as exc:  # reported to the pool, which fails start-up with it
        conn.send(InitError(f"{type(exc).__name__}: {exc}"))
        return
    conn.send(Ready(os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the service is gone
        if isinstance(message, Stop):
            scorer.close()
            return
        assert isinstance(message, Batch), message
        score_batch(conn, progress, scorer, message)


def score_batch(conn: Connection, progress: Any, scorer: Scorer, batch: Batch) -> None:
    if scorer.batched and not any(isinstance(inp, CodeRun) for inp in batch.inputs):
        score_together(conn, progress, scorer, batch)
        return
    pending: list[Scored] = []
    waiting_since = 0.0
    last = len(batch.inputs) - 1
    for index, inp in enumerate(batch.inputs):
        t0 = time.monotonic()
        progress[START], progress[INDEX], progress[JOB] = t0, index, batch.job_id
        try:
            outcome = (
                run_code(scorer, inp, t0)
                if isinstance(inp, CodeRun)
                else Outcome(Status.OK, scorer(inp), "", time.monotonic() - t0)
            )
        except BaseException as exc:  # a verifier that raises (even SystemExit) is an error
            outcome = Outcome(Status.ERROR, None, f"{type(exc).__name__}: {exc}"[:2000], time.monotonic() - t0)
        pending.append(Scored(index, outcome))
        now = time.monotonic()
        waiting_since = waiting_since or now
        if index == last or now - t0 >= FLUSH_S or now - waiting_since >= FLUSH_S:
            conn.send(Results(batch.job_id, tuple(pending)))
            pending, waiting_since = [], 0.0


def score_together(conn: Connection, progress: Any, scorer: Scorer, batch: Batch) -> None:
    """A batched reward (a model) scores the whole batch in one call, under one deadline: the pool's progress names
    its first input while it runs."""
    t0 = time.monotonic()
    progress[START], progress[INDEX], progress[JOB] = t0, 0, batch.job_id
    try:
        results = scorer.score_many(list(batch.inputs))  # type: ignore[arg-type]  # no CodeRun here
    except BaseException as exc:  # the call itself failed: every input of it is an error
        results = [exc] * len(batch.inputs)
    each = (time.monotonic() - t0) / max(1, len(batch.inputs))
    outcomes = [
        Scored(
            i,
            Outcome(Status.ERROR, None, f"{type(r).__name__}: {r}"[:2000], each)
            if isinstance(r, BaseException)
            else Outcome(Status.OK, r, "", each),
        )
        for i, r in enumerate(results)
    ]
    conn.send(Results(batch.job_id, tuple(outcomes)))


def run_code(scorer: Scorer, job: CodeRun, t0: float) -> Outcome:
    """A RunCode job in this process's sandbox (the code verifier's): OK with how it ran, or ERROR when the sandbox
    cannot run it here. The program never runs in this process: the sandbox starts it isolated."""
    if scorer.sandbox is None:
        return Outcome(Status.ERROR, error="this verifier process has no sandbox")
    try:
        ran = scorer.sandbox.run_python(
            "main.py", {"main.py": job.code}, job.stdin, job.wall_timeout_s, memory_mb=job.memory_mb
        )
    except SandboxUnavailable as exc:
        return Outcome(Status.ERROR, error=f"the code sandbox is unavailable: {exc}", seconds=time.monotonic() - t0)
    return Outcome(Status.OK, seconds=time.monotonic() - t0, ran=ran)
