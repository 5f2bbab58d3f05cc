"""Every answer of the verifier pool belongs to its own job: 200 concurrent jobs with distinct expected answers
(scores and RunCode programs in the real sandbox), mixed with verifiers that hang past the deadline (killed),
processes that die, results that race the kill, programs killed by a signal and calls cancelled mid-flight, so
that chunks are cut, requeued and handed to replacement workers while late messages are in flight."""

from __future__ import annotations

import asyncio
import random

import pytest

from relayrl.config.reward import SandboxConfig
from relayrl.reward.api import RewardInput
from relayrl.reward.pool import VerifierPool
from relayrl.reward.protocol import CodeRun, Job, Outcome, Status
from relayrl.reward.scorer import ScorerSpec

pytestmark = pytest.mark.integration

TIMEOUT_S = 3.0
JOBS = 200
KINDS = {
    3: "hang",
    50: "hang",
    97: "hang",
    11: "die",
    64: "die",
    130: "die",
    17: "late",
    88: "late",
    151: "late",
    25: "kill",
    75: "kill",
    125: "kill",
}


def _kind(k: int) -> str:
    return KINDS.get(k, "code" if k % 5 == 0 else "ok")


def _job(k: int) -> Job:
    kind = _kind(k)
    if kind == "code":
        return CodeRun(code=f"print({k})", stdin=b"", wall_timeout_s=TIMEOUT_S - 0.5, memory_mb=256)
    if kind == "kill":  # prints its number, then dies of SIGKILL
        return CodeRun(
            code=f"import os\nprint({k}, flush=True)\nos.kill(os.getpid(), 9)\n",
            stdin=b"",
            wall_timeout_s=TIMEOUT_S - 0.5,
            memory_mb=256,
        )
    return RewardInput("p", f"{kind}:{k}", "", {"late_s": TIMEOUT_S - 0.05})


def _check(k: int, out: Outcome) -> None:
    """``out`` is job ``k``'s own answer (or an explicit failure of it), never another job's."""
    kind, where = _kind(k), f"job {k} ({_kind(k)}): {out}"
    if kind in ("code", "kill"):
        if out.status is Status.TIMEOUT or (out.ran is not None and out.ran.timed_out):
            return  # a sandbox start slower than the deadline on a loaded machine: explicit, and its own
        assert out.status is Status.OK and out.ran is not None, where
        assert out.ran.stdout == f"{k}\n".encode(), where
        assert out.ran.exit_code == (0 if kind == "code" else -9), where
    elif kind == "hang":
        assert out.status is Status.TIMEOUT, where
    elif kind == "die":
        assert out.status is Status.ERROR and "died" in out.error, where
    elif kind == "late" and out.status is Status.TIMEOUT:
        return  # its result lost the race with the kill
    else:
        assert out.status is Status.OK and out.result is not None, where
        assert (out.result.score, out.result.details) == (float(k), f"job {k}"), where


async def _stress() -> tuple[dict[int, Outcome], int, dict[str, int]]:
    rng = random.Random(7)
    pool = VerifierPool(ScorerSpec(function="tests.reward_fns:job_echo"), SandboxConfig(), 3, TIMEOUT_S, chunk_size=4)
    await pool.start()
    answers: dict[int, Outcome] = {}
    cancelled = 0
    try:
        numbers = list(range(JOBS))
        rng.shuffle(numbers)
        groups, i = [], 0
        while i < len(numbers):
            size = rng.randint(1, 6)
            groups.append(numbers[i : i + size])
            i += size

        async def call(index: int, group: list[int]) -> None:
            nonlocal cancelled
            await asyncio.sleep(rng.random() * 0.5)  # calls arrive over time, while others are being scored
            jobs = [_job(k) for k in group]
            try:
                if index % 9 == 4 and all(_kind(k) in ("ok", "code") for k in group):  # its caller gives up
                    outs = await asyncio.wait_for(pool.score_many(jobs), 0.01)
                else:
                    outs = await pool.score_many(jobs)
            except TimeoutError:  # cancelled mid-flight: its jobs may be running, queued or done
                cancelled += len(group)
                return
            for k, out in zip(group, outs, strict=True):
                answers[k] = out

        await asyncio.gather(*(call(n, g) for n, g in enumerate(groups)))
        return answers, cancelled, dict(pool.restarts)
    finally:
        await pool.close()


async def test_every_answer_is_its_own_jobs_through_kills_crashes_late_results_and_cancellations() -> None:
    answers, cancelled, restarts = await _stress()

    assert len(answers) + cancelled == JOBS and cancelled > 0
    for k, out in answers.items():
        _check(k, out)
    scored = [k for k, out in answers.items() if _kind(k) == "ok"]
    assert len(scored) > 100  # most answers are real ones, not failures
    assert restarts["timeout"] >= 3 and restarts["crash"] >= 3  # the hangs were killed, the deaths replaced
