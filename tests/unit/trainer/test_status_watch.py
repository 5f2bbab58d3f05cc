"""The trainer's status stream (relayrl.trainer.status_watch): a change is sent once, at once; nothing else is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from relayrl.common.pb import common_pb2, trainer_pb2, trainer_pb2_grpc
from relayrl.trainer.server import TrainerServicer
from relayrl.trainer.status_watch import MAX_WATCHERS, StatusPulse, status_changes


class _Books:
    """The status a test sets, and a counter of Redis book reads."""

    def __init__(self) -> None:
        self.step = 0
        self.uptime = 0.0
        self.finished = False
        self.reads = 0
        self.read = asyncio.Event()

    def status(self) -> trainer_pb2.TrainerStatus:
        self.uptime += 1.0  # the header's uptime differs on every read
        return trainer_pb2.TrainerStatus(
            component=common_pb2.ComponentStatus(uptime_s=self.uptime), step=self.step, finished=self.finished
        )

    async def refresh(self) -> None:
        self.reads += 1
        self.read.set()


async def _next(stream: AsyncIterator[trainer_pb2.TrainerStatus]) -> trainer_pb2.TrainerStatus:
    return await asyncio.wait_for(anext(stream), 10)


async def test_status_changes_sends_the_status_then_each_change_once_and_ends_when_the_run_finishes() -> None:
    async def scenario() -> list[int]:
        pulse, books = StatusPulse(), _Books()
        stream = status_changes(pulse, books.status, books.refresh, refresh_s=3600)
        steps = [(await _next(stream)).step]
        pulse.notify()  # a pulse without a change (only the uptime moved): nothing is sent
        books.step = 1
        pulse.notify()
        steps.append((await _next(stream)).step)
        books.step, books.finished = 2, True
        pulse.notify()
        last = await _next(stream)
        steps.append(last.step)
        assert last.finished
        with pytest.raises(StopAsyncIteration):
            await _next(stream)
        return steps

    assert await scenario() == [0, 1, 2]


async def test_a_quiet_status_stream_rereads_the_books_so_drops_by_other_ranks_are_seen() -> None:
    async def scenario() -> tuple[int, int]:
        pulse, books = StatusPulse(), _Books()
        stream = status_changes(pulse, books.status, books.refresh, refresh_s=0.01)
        first = await _next(stream)
        reads_at_start = books.reads
        books.step = 5  # changed without a pulse: found after the next book read
        second = await _next(stream)
        assert books.reads > reads_at_start
        await stream.aclose()
        return first.step, second.step

    assert await scenario() == (0, 5)


async def test_status_pulse_wait_returns_at_once_for_a_change_it_missed() -> None:
    async def scenario() -> tuple[bool, bool]:
        pulse = StatusPulse()
        seen = pulse.count
        pulse.notify()
        missed = await pulse.wait(seen, timeout_s=3600)
        quiet = await pulse.wait(pulse.count, timeout_s=0.001)
        return missed, quiet

    assert await scenario() == (True, False)


def _fake_trainer(books: _Books, pulse: StatusPulse) -> Any:
    control = SimpleNamespace(effective_token=lambda: "")
    return SimpleNamespace(
        cfg=SimpleNamespace(control=control),
        progress=SimpleNamespace(changed=pulse),
        status=books.status,
        refresh_drops=books.refresh,
    )


async def test_watch_status_over_the_limit_of_watchers_is_refused_with_resource_exhausted() -> None:
    async def scenario() -> tuple[grpc.StatusCode, int]:
        books, pulse = _Books(), StatusPulse()
        servicer = TrainerServicer(_fake_trainer(books, pulse))
        server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        calls = [stub.WatchStatus(trainer_pb2.WatchTrainerStatusRequest(), timeout=30) for _ in range(MAX_WATCHERS)]
        try:
            for call in calls:  # each watcher has its first status: all are being served
                await asyncio.wait_for(call.read(), 10)
            extra = stub.WatchStatus(trainer_pb2.WatchTrainerStatusRequest(), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(extra.read(), 10)
            served = servicer.watchers
        finally:
            for call in calls:
                call.cancel()
            await channel.close()
            await server.stop(0)
        return refused.value.code(), served

    code, served = await scenario()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert served == MAX_WATCHERS
