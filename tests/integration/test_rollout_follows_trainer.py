"""Rollout refreshes its view of the trainer promptly while admission waits for it (real gRPC, real Redis).

A trainer status server on port 0 whose step the test sets: one with WatchStatus (rollout follows the stream, no
polls), one without (rollout falls back to polling GetStatus). The producer's follower runs as in
``RolloutProducer.run``. Observed by the servicer's call counters and the producer's state.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from relayrl.client import InferenceClient, RewardClient, TrainerClient
from relayrl.common.dataset import PromptCursor, open_prompts
from relayrl.common.pb import common_pb2, trainer_pb2, trainer_pb2_grpc
from relayrl.common.stream import EpisodeStream
from relayrl.config.dataset import DatasetSpec
from relayrl.config.rollout import RolloutConfig
from relayrl.rollout.clients import RolloutClients
from relayrl.rollout.producer import BLOCKED_POLL_DIVISOR, RolloutProducer
from relayrl.trainer.status_watch import StatusPulse, status_changes
from tests.conftest import RedisServer

pytestmark = pytest.mark.integration

POLL_S = 2.0


class _TrainerStatus(trainer_pb2_grpc.TrainerServiceServicer):
    """The trainer's status contract without WatchStatus (an older trainer), with the step the test sets; counts
    the polls."""

    def __init__(self) -> None:
        self.step = 0
        self.calls = 0
        self.polled = asyncio.Event()

    async def GetStatus(
        self, request: trainer_pb2.GetTrainerStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        self.calls += 1
        self.polled.set()
        return self.status()

    def status(self) -> trainer_pb2.TrainerStatus:
        serving = common_pb2.ComponentStatus(state=common_pb2.ServingState.SERVING_STATE_SERVING)
        return trainer_pb2.TrainerStatus(
            component=serving, step=self.step, weight_version=self.step + 1, groups_per_step=2
        )

    async def polls(self, n: int, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while self.calls < n:
                self.polled.clear()
                await self.polled.wait()


@contextlib.asynccontextmanager
async def _following(
    status: _TrainerStatus, redis_url: str, dataset: Path, poll_s: float
) -> AsyncIterator[RolloutProducer]:
    """A producer whose window of step 0 is full (max_staleness 0, 2 groups per step), following ``status``
    (served on port 0) as in ``RolloutProducer.run``; inference and reward are never called."""
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(status, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cfg = RolloutConfig(dataset=dataset, max_staleness=0, status_poll_s=poll_s)
    clients = RolloutClients(
        InferenceClient("127.0.0.1:1"), RewardClient("127.0.0.1:1"), TrainerClient(f"127.0.0.1:{port}", timeout_s=5.0)
    )
    producer = RolloutProducer(
        cfg,
        EpisodeStream.from_url(redis_url, "episodes", "trainers"),
        PromptCursor(open_prompts(DatasetSpec(dataset)).train, False, 0),
        clients,
    )
    producer.admission.admitted = 2
    stop = asyncio.Event()
    follower = asyncio.create_task(producer._follow_trainer(stop))
    try:
        yield producer
    finally:
        stop.set()
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await clients.close()
        await server.stop(0)


async def _until(producer: RolloutProducer, ready: Callable[[], bool]) -> None:
    """Wait, woken by the producer's wake event (each status the follower sees sets it), until ``ready()``."""
    async with asyncio.timeout(30):
        while not ready():
            producer._wake.clear()
            await producer._wake.wait()


async def _scenario(redis_url: str, dataset: Path) -> tuple[str | None, int, int]:
    status = _TrainerStatus()
    async with _following(status, redis_url, dataset, POLL_S) as producer:  # no WatchStatus: it polls
        await _until(producer, lambda: producer.trainer_view.reachable)  # the first poll's answer arrived
        blocked = producer.blocked_by()
        before = status.calls
        await status.polls(before + 3, timeout=2 * POLL_S)  # three polls within two status_poll_s
        status.step = 1  # the trainer finished a step: its window reopens
        await _until(producer, producer.can_admit)  # the poller wakes the admission loop after every refresh
        return blocked, before, status.calls


async def test_while_the_window_is_closed_the_trainer_is_polled_faster_and_a_new_step_reopens_it_promptly(
    redis_server: RedisServer, dataset_path: Path
) -> None:
    blocked, before, calls = await _scenario(redis_server.url, dataset_path)

    # blocked, polls come every status_poll_s / BLOCKED_POLL_DIVISOR (0.4 s): three of them fit within the 4 s
    # deadline that three unhurried polls (3 x 2 s) would miss; then the reopened window was seen
    assert blocked == "window"
    assert calls >= before + 3
    assert BLOCKED_POLL_DIVISOR > 1


class _WatchedTrainer(_TrainerStatus):
    """The same status with WatchStatus, as the trainer serves it (relayrl.trainer.status_watch)."""

    def __init__(self) -> None:
        super().__init__()
        self.pulse = StatusPulse()
        self.watching = asyncio.Event()

    async def WatchStatus(
        self, request: trainer_pb2.WatchTrainerStatusRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.TrainerStatus]:
        async def no_books() -> None:
            return None

        async for status in status_changes(self.pulse, self.status, no_books, refresh_s=3600):
            self.watching.set()
            yield status


async def _watched(redis_url: str, dataset: Path) -> tuple[str | None, bool, int]:
    status = _WatchedTrainer()
    # with a status_poll_s of an hour, a poll would never come in time: only the stream can reopen the window
    async with _following(status, redis_url, dataset, 3600) as producer:
        await asyncio.wait_for(status.watching.wait(), 30)
        await _until(producer, lambda: producer.trainer_view.groups_per_step == 2)
        blocked = producer.blocked_by()
        status.step = 1  # the trainer finished a step and says so
        status.pulse.notify()
        await _until(producer, producer.can_admit)
        return blocked, producer.can_admit(), status.calls


async def test_rollout_follows_the_trainers_status_stream_and_a_new_step_reopens_the_window_without_a_poll(
    redis_server: RedisServer, dataset_path: Path
) -> None:
    blocked, admits, polls = await _watched(redis_server.url, dataset_path)

    assert blocked == "window"
    assert admits
    assert polls == 0  # with a status_poll_s of an hour, only the stream can have reopened it
