"""A trainer's graceful stop has a deadline of its own (the launcher's rule over the trainer's measured steps):
an orphaned trainer, whose launcher was killed, ends by itself. And a weight push ends within its deadline,
retries included, however long inference stays unreachable."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from relayrl.client import InferenceClient
from relayrl.common.weights import iter_update_messages
from relayrl.config.trainer import STOP_MARGIN, graceful_stop_s
from relayrl.trainer.main import _stop_training
from relayrl.trainer.steptime import Longest
from tests.conftest import free_port


def _trainer(deadline_s: float) -> tuple[SimpleNamespace, list[bool]]:
    """A stand-in for relayrl.trainer.runtime.Trainer as _stop_training sees it: stepping, with a stop budget."""
    requested: list[bool] = []
    loop = SimpleNamespace(
        stepping=True,
        request_stop=lambda: requested.append(True),
        stop_budget=lambda: graceful_stop_s(0.0, 0.0, 0.0, deadline_s, 600.0),
    )
    return SimpleNamespace(loop=loop, progress=SimpleNamespace(step=7)), requested


async def test_a_graceful_stop_that_outlasts_its_deadline_is_cancelled_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> tuple[bool, list[bool]]:
        trainer, requested = _trainer(0.2)
        stuck = asyncio.create_task(asyncio.Event().wait())  # a final push or ack that never ends
        # the old code waited for the train task or a second signal only: this bound is the test's, not the code's
        await asyncio.wait_for(_stop_training(trainer, stuck, asyncio.Event()), 30)  # type: ignore[arg-type]
        return stuck.cancelled(), requested

    with caplog.at_level(logging.INFO, logger="relayrl.trainer.main"):
        cancelled, requested = await go()

    assert requested == [True] and cancelled
    assert "the graceful stop did not end within 0.2s: stopping at once" in caplog.text


async def test_a_graceful_stop_that_ends_in_time_is_not_cancelled() -> None:
    async def go() -> bool:
        trainer, requested = _trainer(30.0)

        async def train() -> None:
            while not requested:
                await asyncio.sleep(0)

        task = asyncio.create_task(train())
        await _stop_training(trainer, task, asyncio.Event())  # type: ignore[arg-type]
        return task.done() and not task.cancelled()

    assert await go()


def test_the_stop_budget_follows_the_longest_step_push_and_checkpoint_measured() -> None:
    longest = Longest()
    longest.saw(step_s=12.0, push_s=2.0)
    longest.saw(step_s=8.0, checkpoint_s=6.0)

    budget = graceful_stop_s(longest.step_s, longest.push_s, longest.checkpoint_s, 15.0, 600.0)

    assert (longest.step_s, longest.push_s, longest.checkpoint_s) == (12.0, 2.0, 6.0)
    assert budget.deadline_s == pytest.approx(STOP_MARGIN * 20.0) and budget.bound == "the measured steps"


async def test_a_push_to_an_unreachable_inference_retries_within_its_deadline_then_fails() -> None:
    async def go() -> tuple[grpc.StatusCode, int, float]:
        messages = list(iter_update_messages({"w": torch.zeros(4)}, 1))
        retries: list[grpc.StatusCode] = []
        async with InferenceClient(f"127.0.0.1:{free_port()}", token="t", backoff_s=0.05) as client:
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.update_weights(messages, 1, 2.0, on_retry=retries.append)
            return err.value.code(), len(retries), time.monotonic() - t0

    code, retries, elapsed = await go()

    assert code is grpc.StatusCode.UNAVAILABLE
    assert retries >= 2  # it kept trying while time was left
    # the deadline is the contract: 2 s, plus the last check of whether the push landed (at most 1 s here: nothing
    # listens); the old code retried 5 times with 4 status retries each, about 45 s whatever the deadline
    assert elapsed < 2.0 + 1.0 + 1.0
