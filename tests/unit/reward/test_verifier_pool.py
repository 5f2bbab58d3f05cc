"""The verifier pool alone: per-request timeouts inside a chunk, attribution, requeueing and replacement."""

from __future__ import annotations

import asyncio
import multiprocessing.process
import threading
from pathlib import Path

import pytest

from relayrl.config.reward import SandboxConfig
from relayrl.reward.api import RewardInput
from relayrl.reward.pool import VerifierPool
from relayrl.reward.protocol import Outcome, Status
from relayrl.reward.scorer import ScorerSpec

# A kill lands when the pool's timer fires at the deadline; on a loaded 2-core machine the loop may run that timer
# (and the verifier notice nothing) late by a second or more. The bound proves the kill happens at the deadline,
# not after the rest of the chunk or at a chunk-wide limit: a hang is never scored otherwise.
KILL_MARGIN_S = 3.0


async def _score(
    function: str,
    completions: list[str],
    workers: int = 1,
    timeout_s: float = 1.0,
    chunk_size: int = 32,
    metadata: dict[str, object] | None = None,
) -> tuple[list[Outcome], dict[str, int]]:
    async def go() -> tuple[list[Outcome], dict[str, int]]:
        pool = VerifierPool(ScorerSpec(function=function), SandboxConfig(), workers, timeout_s, chunk_size)
        await pool.start()
        try:
            out = await pool.score_many([RewardInput("p", c, "r", metadata or {}) for c in completions])
            return out, dict(pool.restarts)
        finally:
            await pool.close()

    return await go()


async def test_the_request_that_hangs_is_the_one_that_times_out_even_after_fast_ones_in_its_chunk() -> None:
    out, restarts = await _score("tests.reward_fns:spin", ["a", "b", "c", "hang", "d", "e"])

    assert [o.status for o in out] == [Status.OK, Status.OK, Status.OK, Status.TIMEOUT, Status.OK, Status.OK]
    assert restarts == {"timeout": 1, "crash": 0}
    assert 1.0 <= out[3].seconds < 1.0 + KILL_MARGIN_S  # how long the hung request had run when it was killed


async def test_timeout_is_per_request_not_per_chunk() -> None:
    out, restarts = await _score("tests.reward_fns:slow", ["0.4", "0.4", "0.4"], timeout_s=0.7)

    assert [o.status for o in out] == [Status.OK] * 3
    assert restarts == {"timeout": 0, "crash": 0}
    # one worker ran the chunk: together its requests ran past the timeout, each alone under it
    assert sum(o.seconds for o in out) > 0.7 > max(o.seconds for o in out)


async def test_a_crash_fails_only_its_request_and_the_rest_of_the_chunk_is_scored_by_the_replacement() -> None:
    out, restarts = await _score("tests.reward_fns:crash", ["a", "crash", "b", "c"])

    assert [o.status for o in out] == [Status.OK, Status.ERROR, Status.OK, Status.OK]
    assert restarts == {"timeout": 0, "crash": 1}


async def test_requests_spread_over_the_workers() -> None:
    out, _ = await _score("tests.reward_fns:pid", ["x"] * 8, workers=2)

    assert len({o.result.details for o in out if o.result is not None}) == 2


async def test_workers_score_at_the_same_time(tmp_path: Path) -> None:
    out, _ = await _score(
        "tests.reward_fns:rendezvous",
        ["x"] * 3,
        workers=3,
        timeout_s=10.0,
        metadata={"dir": str(tmp_path), "expect": 3, "wait_s": 5.0},
    )

    # each verifier saw all three started while it was running: three ran at once (serially, the first sees 1)
    assert [(o.status, o.result.details if o.result else "") for o in out] == [(Status.OK, "3")] * 3


async def test_no_process_is_joined_on_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    joins: list[tuple[str, bool]] = []
    join = multiprocessing.process.BaseProcess.join

    def recording_join(self: multiprocessing.process.BaseProcess, timeout: float | None = None) -> None:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        joins.append((threading.current_thread().name, on_loop))
        join(self, timeout)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "join", recording_join)

    crashed, _ = await _score("tests.reward_fns:crash", ["a", "crash", "b"])  # reaps the dead worker
    hung, _ = await _score("tests.reward_fns:spin", ["hang", "a"], timeout_s=0.5)  # reaps the killed worker

    assert [o.status for o in crashed + hung] == [Status.OK, Status.ERROR, Status.OK, Status.TIMEOUT, Status.OK]
    assert joins and not any(on_loop for _, on_loop in joins), joins
