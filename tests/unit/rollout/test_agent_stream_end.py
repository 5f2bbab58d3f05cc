"""A streamed agent call ends exactly once however its response ends (relayrl.rollout.workflows.agent_stream):
recorded, or its token budget released and inference's request cancelled, also when the client goes away before
the first event and Starlette never starts the events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from relayrl.rollout.workflows.agent_session import Session, SessionLimits
from relayrl.rollout.workflows.agent_stream import ClosingStreamingResponse, StreamEnd


class FakeCall:
    def __init__(self) -> None:
        self.cancels = 0

    def cancel(self) -> None:
        self.cancels += 1


def planned() -> tuple[Session, StreamEnd, FakeCall]:
    session = Session(
        SessionLimits(max_calls=4, max_call_tokens=16, max_session_tokens=64, max_episode_tokens=64), timeout_s=60
    )
    call = FakeCall()
    return session, StreamEnd(session, session.plan([1, 2, 3], 16), call), call


def scope(spec_version: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}}


async def events(started: list[bool]) -> AsyncIterator[str]:
    """The call's events; ``started`` says whether anything began iterating them."""
    started.append(True)
    yield "data: {}\n\n"


async def test_a_client_gone_before_the_first_event_releases_the_budget_when_the_send_fails() -> None:
    session, end, call = planned()
    started: list[bool] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("the client is gone")  # ASGI 2.4: the response's start fails

    reserved = session.reserved
    with pytest.raises(ClientDisconnect):
        await ClosingStreamingResponse(events(started), end.close)(scope("2.4"), receive, send)

    assert reserved == 16 and session.reserved == 0  # what the planned call had reserved is free again
    assert started == [] and call.cancels == 1 and end.closed


async def test_a_client_gone_before_the_first_event_releases_the_budget_when_the_stream_is_cancelled() -> None:
    session, end, call = planned()
    started: list[bool] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}  # ASGI before 2.4: a listener sees the disconnect and cancels the stream

    async def send(message: dict[str, Any]) -> None:
        await asyncio.Event().wait()  # the response's start never gets through

    await ClosingStreamingResponse(events(started), end.close)(scope("2.3"), receive, send)

    assert session.reserved == 0 and started == [] and call.cancels == 1


def test_a_recorded_call_keeps_its_tokens_and_the_end_runs_once() -> None:
    session, end, call = planned()
    end.recorded = True  # the sample finished and was recorded (Session.record takes its reservation)

    end.close()
    end.close()

    assert session.reserved == 16 and call.cancels == 1  # nothing released by the end itself; one cancel

    _, unrecorded, other = planned()
    unrecorded.close()
    unrecorded.close()
    assert unrecorded.session.reserved == 0 and other.cancels == 1  # released once, never below zero
