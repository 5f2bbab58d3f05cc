"""Module-level reward functions for the reward tests (verifier workers import them by module:function)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

from relayrl.reward.api import RewardInput, RewardResult, runs_code
from relayrl.reward.sandbox import Sandbox


def broken(inp: RewardInput) -> float:
    raise ZeroDivisionError("verifier bug")


def returns_nan(inp: RewardInput) -> float:
    return float("nan")


def returns_text(inp: RewardInput) -> object:
    return "1.0"


def returns_none(inp: RewardInput) -> object:
    return None


def slow(inp: RewardInput) -> float:
    """Sleeps for the number of seconds in the completion (a float), then scores 1."""
    time.sleep(float(inp.completion or 0))
    return 1.0


def spin(inp: RewardInput) -> float:
    """A verifier that never returns when the completion says so (a busy loop: no sleep to interrupt)."""
    while inp.completion == "hang":
        pass
    return 1.0


def crash(inp: RewardInput) -> float:
    """Kills its own process when the completion says so (like a segfault in a native extension)."""
    if inp.completion == "crash":
        os._exit(3)
    return 1.0


def exits(inp: RewardInput) -> float:
    raise SystemExit(0)


def rendezvous(inp: RewardInput) -> RewardResult:
    """Records its start as a file in the directory ``metadata["dir"]``, then waits (at most ``metadata["wait_s"]``)
    until ``metadata["expect"]`` verifiers have started; details: how many had started when it stopped waiting.
    Verifiers that run at the same time all see ``expect``; run one after another, the first sees 1."""
    directory, expect = Path(inp.metadata["dir"]), int(inp.metadata["expect"])
    (directory / f"{os.getpid()}-{uuid.uuid4().hex}").touch()
    deadline = time.monotonic() + float(inp.metadata.get("wait_s", 5.0))
    while (started := len(list(directory.iterdir()))) < expect and time.monotonic() < deadline:
        time.sleep(0.01)
    return RewardResult(score=1.0, details=str(started))


def sandbox_backend(inp: RewardInput, *, sandbox: Sandbox) -> RewardResult:
    """A verifier that takes the service's sandbox: says which backend it was given."""
    return RewardResult(score=1.0, details=str(sandbox.cfg.backend))


def keywords(inp: RewardInput, **params: Any) -> RewardResult:
    """A plugin with the plain signature fn(inp, **params): names the keywords it was called with."""
    return RewardResult(score=1.0, details=",".join(sorted(params)))


def pid(inp: RewardInput) -> RewardResult:
    """Scores 1 and says which process scored it."""
    return RewardResult(score=1.0, details=str(os.getpid()))


async def async_half(inp: RewardInput) -> RewardResult:
    await asyncio.sleep(0)
    return RewardResult(score=0.5, components={"half": 0.5}, details=inp.completion)


def length(inp: RewardInput, scale: float = 1.0) -> float:
    """A parameterised function: scale x len(completion)."""
    return scale * len(inp.completion)


_calls = 0


def flaky(inp: RewardInput) -> RewardResult:
    """The arithmetic reward, except that prompts starting with 1 or 2 fail for every sample (their whole group
    errors) and every third call in a worker process raises (some samples of other groups error)."""
    from relayrl.tasks.arithmetic import reward

    global _calls
    _calls += 1
    if inp.prompt[:1] in ("1", "2"):
        raise ValueError("unverifiable prompt")
    if _calls % 3 == 0:
        raise ValueError("flaky verifier")
    return reward(inp)


def says_nothing(inp: RewardInput) -> float:
    """1.0 for an empty completion when the reference is "nothing" (the end-of-turn model's only answer)."""
    return 1.0 if not inp.completion.strip() and inp.reference == "nothing" else 0.0


def uniform_for_some_prompts(inp: RewardInput) -> float:
    """0.5 for every completion of prompts starting with 1 or 3 (their groups carry zero advantage); otherwise a
    score that differs between completions (a hash of the text), so those groups carry advantage."""
    import zlib

    if inp.prompt[:1] in ("1", "3"):
        return 0.5
    return zlib.crc32(inp.completion.encode()) / 2**32


def constant(inp: RewardInput) -> float:
    """0 for everything: every group-baseline advantage is zero (pure on-policy distillation)."""
    return 0.0


def job_echo(inp: RewardInput) -> RewardResult:
    """Scores the job number in the completion ``"<kind>:<k>"`` as k (details name it too), after misbehaving as
    ``kind`` says: ``ok`` at once, ``hang`` past any deadline, ``die`` (the process exits), ``late`` (sleeps
    metadata["late_s"], about the pool's deadline: its result races the kill)."""
    kind, number = inp.completion.split(":")
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "die":
        os._exit(5)
    if kind == "late":
        time.sleep(float(inp.metadata["late_s"]))
    return RewardResult(score=float(number), details=f"job {number}")


@runs_code
def runs_a_program(inp: RewardInput) -> RewardResult:
    """A plugin that declares it runs code (no sandbox parameter): it leaves the file metadata["marker"] behind, so
    a test sees whether it ran."""
    Path(inp.metadata["marker"]).touch()
    return RewardResult(score=1.0, details="ran")
