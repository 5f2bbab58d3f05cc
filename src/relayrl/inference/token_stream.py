"""Tokens as they are sampled, from the engine's thread to a front end's event loop: shared by the REST API's
server-sent events (relayrl.inference.http_stream) and gRPC's GenerateStream (relayrl.inference.server).

:func:`feed` points each input's ``on_token`` at a queue of the running loop (before the inputs are submitted);
:func:`events` then yields ``("token", input index, TokenEvent)`` as the engine samples and ``("done", input index,
samples)`` as each request finishes. Closing the iterator (the client went away, the deadline passed) cancels every
request in the engine, which frees their rows before its next decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from typing import Any

from relayrl.inference.engine import GenerationInput, SampleOutput, TokenEvent
from relayrl.inference.serving import InferenceService

Submitted = tuple[Future[list[SampleOutput]], float]  # what InferenceService.submit returns
Event = tuple[str, int, Any]  # ("token", input index, TokenEvent) or ("done", input index, list[SampleOutput])


def cancel(submitted: Sequence[Submitted]) -> None:
    """Cancel submitted requests in the engine (a finished one is left as it is)."""
    for future, _ in submitted:
        future.cancel()


def _post(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Event], index: int, ev: TokenEvent) -> None:
    """Engine thread → event loop. Never raises into the engine (the loop may be gone with its client)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(queue.put_nowait, ("token", index, ev))


def feed(inputs: Sequence[GenerationInput]) -> asyncio.Queue[Event]:
    """Point every input's ``on_token`` at a new queue of the running loop (call before submitting them)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()
    for i, inp in enumerate(inputs):
        inp.on_token = lambda ev, i=i: _post(loop, queue, i, ev)  # type: ignore[misc]
    return queue


async def events(
    service: InferenceService, queue: asyncio.Queue[Event], submitted: Sequence[Submitted], api: str
) -> AsyncIterator[Event]:
    """The tokens and results of the ``submitted`` requests, fed by :func:`feed`, in the order they happen (a
    request's tokens before its result); a failed request raises at its result. Each request is counted as
    ``api`` in the service's metrics. Closing the iterator cancels every request in the engine."""
    tasks: list[asyncio.Task[list[SampleOutput]]] = []
    try:
        for i, s in enumerate(submitted):
            task = asyncio.ensure_future(service.result(s, api))
            task.add_done_callback(lambda t, i=i: queue.put_nowait(("done", i, t)))  # type: ignore[misc]
            tasks.append(task)
        for _ in submitted:
            while True:
                kind, i, item = await queue.get()
                if kind == "token":
                    yield kind, i, item
                    continue
                yield kind, i, item.result()  # a failed request raises here
                break
    finally:
        cancel(submitted)
        for task in tasks:
            task.cancel()
