"""One publication's fan-out to the inference replicas: one :class:`Leg` per transport in use (the version prepared
once for its replicas), every replica's UpdateWeights call at once, each transport's delivery work (a broadcast)
beside its calls, and the laggard rule that keeps a dead replica from holding a publication up."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from relayrl.common.pb.inference_pb2 import WeightUpdateMessage
from relayrl.trainer.transports import Delivery, Transport, Weights, laggard_grace_s

log = logging.getLogger(__name__)

Send = Callable[[str, Sequence[WeightUpdateMessage], int], Coroutine[Any, Any, Any]]


@dataclass
class Leg:
    """The replicas one transport serves in a push, its prepared messages and its delivery."""

    transport: Transport
    targets: list[str]
    messages: Sequence[WeightUpdateMessage]
    delivery: Delivery

    @property
    def sha256(self) -> str:
        """The checksum of what this leg sends (by its transport's algorithm): what its replicas must serve."""
        return str(self.messages[-1].manifest.sha256)


def prepare_legs(
    params: Weights, version: int, probe: Sequence[Sequence[int]], by_transport: Sequence[tuple[Transport, list[str]]]
) -> list[Leg]:
    """Each transport's messages for ``version``, prepared once, and its delivery to its replicas (blocking)."""
    legs = []
    for transport, targets in by_transport:
        messages = transport.prepare(params, version, probe)
        legs.append(Leg(transport, targets, messages, transport.deliver(params, messages, len(targets))))
    return legs


async def fan_out(legs: Sequence[Leg], send: Send, version: int) -> dict[str, Any]:
    """Each target's answer, or its error (a RuntimeError for a replica that failed or lagged). Once one replica
    answered, the others get ``laggard_grace_s`` more. Each leg's delivery work runs beside its calls; when it
    fails, so does every call that waited for it."""
    tasks: dict[str, asyncio.Task[Any]] = {
        t: asyncio.create_task(send(t, leg.delivery.messages(i), version))
        for leg in legs
        for i, t in enumerate(leg.targets)
    }

    def failed_in(leg: Leg) -> Callable[[int], bool]:
        def failed(i: int) -> bool:
            task = tasks[leg.targets[i]]
            return task.done() and (task.cancelled() or task.exception() is not None)

        return failed

    besides = [asyncio.create_task(asyncio.to_thread(leg.delivery.run, failed_in(leg))) for leg in legs]
    try:
        started, pending = time.monotonic(), set(tasks.values())
        while pending and not any(t.done() and not t.cancelled() and t.exception() is None for t in tasks.values()):
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if pending:  # one replica answered: the others get a bounded while more
            _, pending = await asyncio.wait(pending, timeout=laggard_grace_s(time.monotonic() - started))
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        # a broadcast ends with its members' calls: done, failed, or at its group's timeout
        for error in await asyncio.gather(*besides, return_exceptions=True):
            if isinstance(error, BaseException):
                log.warning("weight version %d: the delivery beside the calls failed: %s", version, error)
    return {
        target: RuntimeError(f"weight push of version {version}: no answer in time while other replicas answered")
        if t.cancelled()
        else (t.exception() or t.result())
        for target, t in tasks.items()
    }
