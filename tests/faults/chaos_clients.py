"""Unauthenticated stream holders for the chaos test: a process that holds open every gRPC stream it can on the
stack's ports, with no credential, until each port answers RESOURCE_EXHAUSTED, and keeps them open (a stream
that ends, or a service that restarts, is opened again; a refused one is retried every second, so a slot freed
by anyone is taken back at once).

    python -m tests.faults.chaos_clients STATS.json LIFETIME_S NAME=KIND@HOST:PORT#SLOTS ...

KIND: ``health`` (grpc.health.v1 Watch), ``trainer_watch`` (TrainerService.WatchStatus), ``update_weights``
(InferenceService.UpdateWeights, a client stream that never sends its first message), ``generate``
(InferenceService.GenerateStream of long samples). SLOTS: how many such calls to keep trying (bounded). Loopback
only. Every second the counts per target go to STATS.json (written whole, then renamed): ``held`` (open now),
``refused`` (status code -> calls refused on opening), ``ended`` (status code -> held calls that ended),
``opened`` (calls that ever got through). The process exits by itself
after LIFETIME_S, and with the test (it runs with ``die_with_parent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relayrl.common.pb import inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc

KINDS = ("health", "trainer_watch", "update_weights", "generate")
# a service being restarted is retried within a second, not after grpc's exponential reconnect back-off
CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
OPEN_WAIT_S = 2.0  # a call that neither failed nor answered within this is held (UpdateWeights never answers)


@dataclass
class Target:
    name: str
    kind: str
    address: str
    slots: int
    held: int = 0
    opened: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # status code -> calls refused on opening
    ended: Counter[str] = field(default_factory=Counter)  # status code -> held calls that ended

    def stats(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "address": self.address,
            "slots": self.slots,
            "held": self.held,
            "opened": self.opened,
            "refused": dict(self.refused),
            "ended": dict(self.ended),
        }


def parse_target(text: str) -> Target:
    name, rest = text.split("=", 1)
    kind, rest = rest.split("@", 1)
    address, slots = rest.rsplit("#", 1)
    if kind not in KINDS or not address.startswith("127.0.0.1:"):
        raise SystemExit(f"bad target {text!r} (kinds {KINDS}, loopback only)")
    return Target(name, kind, address, int(slots))


class _NeverSend:
    """A request stream whose first message never comes."""

    def __aiter__(self) -> _NeverSend:
        return self

    async def __anext__(self) -> inference_pb2.WeightUpdateMessage:
        await asyncio.Event().wait()
        raise StopAsyncIteration


def _call(target: Target, channel: grpc.aio.Channel) -> Any:
    if target.kind == "health":
        return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    if target.kind == "trainer_watch":
        return trainer_pb2_grpc.TrainerServiceStub(channel).WatchStatus(trainer_pb2.WatchTrainerStatusRequest())
    if target.kind == "update_weights":
        return inference_pb2_grpc.InferenceServiceStub(channel).UpdateWeights(_NeverSend())
    request = inference_pb2.GenerateRequest(
        prompt_text="1+2=",
        sampling=inference_pb2.SamplingParams(n=1, temperature=1.0, max_new_tokens=200, ignore_eos=True),
    )  # within the tiny model's 256
    return inference_pb2_grpc.InferenceServiceStub(channel).GenerateStream(request)


async def _hold_one(target: Target, channel: grpc.aio.Channel) -> None:
    """Open one call and hold it until it ends; count how it went."""
    call = _call(target, channel)
    unary: asyncio.Future[Any] | None = None
    try:
        if target.kind == "update_weights":
            unary = asyncio.ensure_future(call)
            done, _ = await asyncio.wait({unary}, timeout=OPEN_WAIT_S)
            if done:
                unary.result()  # answered although no body came: nothing held
                return
        else:
            await asyncio.wait_for(call.read(), OPEN_WAIT_S)
    except TimeoutError:
        pass  # open and silent: held
    except grpc.aio.AioRpcError as exc:
        target.refused[exc.code().name] += 1
        return
    target.held += 1
    target.opened += 1
    try:
        if unary is not None:
            await unary
        else:
            while await call.read() is not grpc.aio.EOF:
                pass
    except grpc.aio.AioRpcError as exc:
        target.ended[exc.code().name] += 1
    finally:
        target.held -= 1
        call.cancel()


async def _slot(target: Target, channel: grpc.aio.Channel) -> None:
    while True:
        try:
            await _hold_one(target, channel)
        except Exception as exc:
            target.refused[type(exc).__name__] += 1
        await asyncio.sleep(1.0)


async def _report(targets: list[Target], path: Path) -> None:
    while True:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({t.name: t.stats() for t in targets}))
        os.replace(tmp, path)
        await asyncio.sleep(1.0)


async def main(stats: Path, lifetime_s: float, targets: list[Target]) -> None:
    tasks = []
    for target in targets:
        # separate connections (a local subchannel pool each), 64 calls a connection at most
        channels = [
            grpc.aio.insecure_channel(target.address, options=CHANNEL_OPTIONS) for _ in range((target.slots + 63) // 64)
        ]
        tasks += [asyncio.create_task(_slot(target, channels[i // 64])) for i in range(target.slots)]
    tasks.append(asyncio.create_task(_report(targets, stats)))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*tasks), lifetime_s)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), float(sys.argv[2]), [parse_target(a) for a in sys.argv[3:]]))
