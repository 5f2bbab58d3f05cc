"""Rollout refreshes its view of the trainer promptly while admission waits for it (real gRPC, real Redis).

A trainer status server on port 0 whose step the test sets: one with WatchStatus (rollout follows the stream, no
polls), one without (rollout falls back to polling GetStatus). The producer's follower runs as in
``RolloutProducer.run``. Observed by the servicer's call counters and the producer's state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from relayrl.client import InferenceClient, RewardClient, TrainerClient
from relayrl.common.dataset import PromptCursor, load_jsonl
from relayrl.common.pb import common_pb2, trainer_pb2, trainer_pb2_grpc
from relayrl.common.stream import EpisodeStream
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

    async def GetStatus(self, request: trainer_pb2.GetTrainerStatusRequest,
                        context: grpc.aio.ServicerContext) -> trainer_pb2.TrainerStatus:
        self.calls += 1
        self.polled.set()
        return self.status()

    def status(self) -> trainer_pb2.TrainerStatus:
        serving = common_pb2.ComponentStatus(state=common_pb2.ServingState.SERVING_STATE_SERVING)
        return trainer_pb2.TrainerStatus(component=serving, step=self.step, weight_version=self.step + 1,
                                         groups_per_step=2)

    async def polls(self, n: int, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while self.calls < n:
                self.polled.clear()
                await self.polled.wait()


async def _scenario(redis_url: str, dataset: Path) -> tuple[float, float, int]:
    status = _TrainerStatus()
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(status, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cfg = RolloutConfig(dataset=dataset, max_staleness=0, status_poll_s=POLL_S)
    clients = RolloutClients(InferenceClient("127.0.0.1:1"), RewardClient("127.0.0.1:1"),
                             TrainerClient(f"127.0.0.1:{port}", timeout_s=5.0))
    producer = RolloutProducer(cfg, EpisodeStream.from_url(redis_url, "episodes", "trainers"),
                               PromptCursor(load_jsonl(dataset), False, 0), clients)
    producer.admission.admitted = 2  # the whole window of step 0 (max_staleness 0, 2 groups per step)
    stop = asyncio.Event()
    poller = asyncio.create_task(producer._follow_trainer(stop))  # no WatchStatus: it polls
    try:
        await status.polls(1, timeout=30)
        t0 = time.monotonic()
        await status.polls(4, timeout=30)  # three more polls while the window is closed
        three_polls_s = time.monotonic() - t0
        blocked = producer.blocked_by()
        status.step = 1  # the trainer finished a step: its window reopens
        t1 = time.monotonic()
        async with asyncio.timeout(30):
            while not producer.can_admit():  # the poller wakes the admission loop after every refresh
                producer._wake.clear()
                await producer._wake.wait()
        reopened_s = time.monotonic() - t1
        assert blocked == "window"
        return three_polls_s, reopened_s, status.calls
    finally:
        stop.set()
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        await clients.close()
        await server.stop(0)


def test_while_the_window_is_closed_the_trainer_is_polled_faster_and_a_new_step_reopens_it_promptly(
        redis_server: RedisServer, dataset_path: Path) -> None:
    three_polls_s, reopened_s, calls = asyncio.run(_scenario(redis_server.url, dataset_path))

    # at status_poll_s three polls would take 3 x 2 s; blocked, they come every status_poll_s / 5 (1.2 s)
    assert three_polls_s < POLL_S, (three_polls_s, calls)
    assert reopened_s < POLL_S  # within about one blocked interval, not a whole status_poll_s
    assert BLOCKED_POLL_DIVISOR > 1


class _WatchedTrainer(_TrainerStatus):
    """The same status with WatchStatus, as the trainer serves it (relayrl.trainer.status_watch)."""

    def __init__(self) -> None:
        super().__init__()
        self.pulse = StatusPulse()
        self.watching = asyncio.Event()

    async def WatchStatus(self, request: trainer_pb2.WatchTrainerStatusRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[trainer_pb2.TrainerStatus]:
        async def no_books() -> None:
            return None

        async for status in status_changes(self.pulse, self.status, no_books, refresh_s=3600):
            self.watching.set()
            yield status


async def _watched(redis_url: str, dataset: Path) -> tuple[str | None, bool, int]:
    status = _WatchedTrainer()
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(status, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cfg = RolloutConfig(dataset=dataset, max_staleness=0, status_poll_s=3600)  # a poll would never come in time
    clients = RolloutClients(InferenceClient("127.0.0.1:1"), RewardClient("127.0.0.1:1"),
                             TrainerClient(f"127.0.0.1:{port}", timeout_s=5.0))
    producer = RolloutProducer(cfg, EpisodeStream.from_url(redis_url, "episodes", "trainers"),
                               PromptCursor(load_jsonl(dataset), False, 0), clients)
    producer.admission.admitted = 2  # the whole window of step 0
    stop = asyncio.Event()
    follower = asyncio.create_task(producer._follow_trainer(stop))
    try:
        async with asyncio.timeout(30):
            await status.watching.wait()
            while producer.trainer_view.groups_per_step != 2:
                producer._wake.clear()
                await producer._wake.wait()
        blocked = producer.blocked_by()
        status.step = 1  # the trainer finished a step and says so
        status.pulse.notify()
        async with asyncio.timeout(30):
            while not producer.can_admit():
                producer._wake.clear()
                await producer._wake.wait()
        return blocked, producer.can_admit(), status.calls
    finally:
        stop.set()
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await clients.close()
        await server.stop(0)


def test_rollout_follows_the_trainers_status_stream_and_a_new_step_reopens_the_window_without_a_poll(
        redis_server: RedisServer, dataset_path: Path) -> None:
    blocked, admits, polls = asyncio.run(_watched(redis_server.url, dataset_path))

    assert blocked == "window"
    assert admits
    assert polls == 0  # with a status_poll_s of an hour, only the stream can have reopened it
