"""Simulated inference replicas for bench/scale_sim.py: N real ``grpc.aio`` InferenceService servers in one process,
each a latency model of a continuous-batching engine (no model compute).

Latency model, per replica: a decode step of ``step_s`` advances every running sequence by one token; at most
``max_batch`` sequences run at once (each sample of a request takes a slot; a request waits, first come first
served, until all its n samples fit); a request admitted at a step spends ``prefill_steps`` steps in prefill, its
slots held, before its first token. A sample is ``max_new_tokens`` long, or, with probability ``eos_prob``, ends
earlier at a length drawn uniformly from 1..max_new_tokens (seeded per replica). One clock drives every replica's
steps (sleeps, not busy loops); when this process is too busy to keep the clock, steps get longer, and the exit
report's ``step_ratio`` (nominal / actual step time) says so.

Answers are valid for the tiny model (relayrl.tasks.tiny_model: 3 specials then ``0123456789+-*= ``): token ids of
digit characters, the text those ids decode to, a logprob per token, each token stamped with weight version 0 (the
simulated trainer publishes nothing). Samples are precomputed per length, so an answer costs a few proto copies.

Also the simulated trainer (:class:`SimTrainer`) that bench/scale_sim.py serves in its own process.

Run alone: ``python bench/scale_sim_replicas.py --replicas 4``: prints one JSON line ``{"ports": [...]}`` once every
server listens; on SIGTERM prints ``{"ticks", "elapsed_s", "step_ratio", "requests", "samples"}`` and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import redis.asyncio as aioredis

from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.pb import trainer_pb2, trainer_pb2_grpc
from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH, FINISH_REASON_STOP, ComponentStatus, ServingState

SPECIALS = 3  # <pad> <eos> <unk> come first in the tiny model's vocabulary (relayrl.tasks.tiny_model)
CHARS = "0123456789+-*= "  # its characters, one token each after the specials
DIGIT_IDS = [SPECIALS + CHARS.index(c) for c in "0123456789"]
VARIANTS = 8  # precomputed samples per length
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


@dataclass
class SimRequest:
    n: int
    future: asyncio.Future[None]


@dataclass
class SimEngine:
    """One replica's continuous-batching latency model, advanced by :meth:`tick` (one decode step)."""

    max_batch: int
    prefill_steps: int
    step: int = 0
    free: int = 0
    waiting: deque[tuple[SimRequest, list[int]]] = field(default_factory=deque)
    due: dict[int, list[tuple[SimRequest | None, int]]] = field(default_factory=dict)  # step -> (done, slots freed)
    running: int = 0

    def __post_init__(self) -> None:
        self.free = self.max_batch

    def submit(self, lengths: list[int]) -> asyncio.Future[None]:
        """A request of len(lengths) samples; the future is set at the step its longest sample ends."""
        request = SimRequest(min(len(lengths), self.max_batch), asyncio.get_running_loop().create_future())
        self.waiting.append((request, lengths))
        return request.future

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.due)

    def tick(self) -> None:
        self.step += 1
        for request, slots in self.due.pop(self.step, ()):
            self.free += slots
            self.running -= slots
            if request is not None and not request.future.done():
                request.future.set_result(None)
        while self.waiting and self.waiting[0][0].n <= self.free:
            request, lengths = self.waiting.popleft()
            if request.future.done():  # cancelled while it waited
                continue
            self.free -= request.n
            self.running += request.n
            start = self.step + self.prefill_steps
            admitted = lengths[: request.n]  # (n > max_batch: the first max_batch samples set the time)
            for length in admitted:
                self.due.setdefault(start + length, []).append((None, 1))
            self.due.setdefault(start + max(admitted), []).append((request, 0))


class SampleBank:
    """Precomputed Sample messages: ``VARIANTS`` per length, digit tokens and their text."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.samples: dict[tuple[int, bool], list[pb.Sample]] = {}

    def get(self, length: int, stopped: bool) -> pb.Sample:
        key = (length, stopped)
        if key not in self.samples:
            reason = FINISH_REASON_STOP if stopped else FINISH_REASON_LENGTH
            self.samples[key] = [self._make(length, reason) for _ in range(VARIANTS)]
        return self.rng.choice(self.samples[key])

    def _make(self, length: int, reason: int) -> pb.Sample:
        ids = [self.rng.choice(DIGIT_IDS) for _ in range(length)]
        return pb.Sample(
            token_ids=ids,
            logprobs=[-self.rng.random() * 2.0 for _ in ids],
            weight_versions=[0] * length,
            finish_reason=reason,  # type: ignore[arg-type]
            text="".join(CHARS[i - SPECIALS] for i in ids),
        )


class SimInference(pb_grpc.InferenceServiceServicer):
    """InferenceService on a :class:`SimEngine`: Generate, GenerateBatch and GetStatus (what rollout calls)."""

    def __init__(self, engine: SimEngine, bank: SampleBank, eos_prob: float, seed: int) -> None:
        self.engine, self.bank, self.eos_prob = engine, bank, eos_prob
        self.rng = random.Random(seed)
        self.prompts: dict[str, list[int]] = {}
        self.requests = self.samples = 0
        self.started = time.time()

    def _lengths(self, n: int, max_new: int) -> list[int]:
        return [self.rng.randint(1, max_new) if self.rng.random() < self.eos_prob else max_new for _ in range(n)]

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        text = request.prompt_text if request.WhichOneof("prompt") == "prompt_text" else "0+0="
        if text not in self.prompts:
            self.prompts[text] = [SPECIALS + CHARS.index(c) if c in CHARS else 2 for c in text]
        return self.prompts[text]

    async def _one(self, request: pb.GenerateRequest) -> pb.GenerateResponse:
        max_new = max(int(request.sampling.max_new_tokens), 1)
        lengths = self._lengths(max(int(request.sampling.n), 1), max_new)
        await self.engine.submit(lengths)
        self.requests += 1
        self.samples += len(lengths)
        return pb.GenerateResponse(
            request_id=request.request_id,
            prompt_token_ids=self._prompt_ids(request),
            samples=[self.bank.get(n, n < max_new) for n in lengths],
        )

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        return await self._one(request)

    async def GenerateBatch(
        self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateBatchResponse:
        responses = await asyncio.gather(*(self._one(r) for r in request.requests))
        return pb.GenerateBatchResponse(responses=responses)

    async def GenerateBatchStream(
        self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateBatchItem]:
        async def one(i: int) -> pb.GenerateBatchItem:
            return pb.GenerateBatchItem(index=i, response=await self._one(request.requests[i]))

        for next_done in asyncio.as_completed([one(i) for i in range(len(request.requests))]):
            yield await next_done

    async def GetStatus(
        self, request: pb.GetInferenceStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.InferenceStatus:
        return pb.InferenceStatus(
            component=ComponentStatus(
                component="inference", state=ServingState.SERVING_STATE_SERVING, uptime_s=time.time() - self.started
            ),
            weight_version=0,
            model_path="simulated",
            requests_served=self.requests,
            sequences_running=self.engine.running,
            requests_queued=len(self.engine.waiting),
            engine="simulated",
        )


class SimTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """A trainer that consumes the stream as fast as groups arrive and reports a step per ``groups_per_step``."""

    def __init__(self, redis_url: str, stream: str, group: str, groups_per_step: int) -> None:
        self.redis = aioredis.from_url(redis_url)
        self.stream, self.group, self.groups_per_step = stream, group, groups_per_step
        self.groups = 0
        self._changed = asyncio.Event()

    def status(self) -> trainer_pb2.TrainerStatus:
        return trainer_pb2.TrainerStatus(
            component=ComponentStatus(component="trainer", state=ServingState.SERVING_STATE_SERVING),
            step=self.groups // self.groups_per_step,
            weight_version=0,
            groups_per_step=self.groups_per_step,
            groups_trained=self.groups,
        )

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext) -> trainer_pb2.TrainerStatus:
        return self.status()

    async def WatchStatus(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        while True:
            changed = self._changed
            yield self.status()
            await changed.wait()

    async def consume(self) -> None:
        with contextlib.suppress(aioredis.ResponseError):  # BUSYGROUP: rollout created it first
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        while True:
            reply: Any = await self.redis.xreadgroup(self.group, "sim", {self.stream: ">"}, count=1024, block=100)
            ids = [entry_id for _, items in reply or [] for entry_id, _ in items]
            if not ids:
                continue
            await self.redis.xack(self.stream, self.group, *ids)
            await self.redis.xdel(self.stream, *ids)
            step = self.groups // self.groups_per_step
            self.groups += len(ids)
            if self.groups // self.groups_per_step != step:
                changed, self._changed = self._changed, asyncio.Event()
                changed.set()

    async def appended(self) -> int:
        """Groups ever appended to the stream (XINFO STREAM entries-added)."""
        try:
            info: Any = await self.redis.xinfo_stream(self.stream)
        except aioredis.ResponseError:
            return 0
        return int(info["entries-added"])


@dataclass
class Clock:
    """One decode step of every busy replica each ``step_s`` (absolute schedule; a late step starts at once and the
    schedule restarts from it, as a slow engine step would)."""

    engines: list[SimEngine]
    step_s: float
    ticks: int = 0
    elapsed_s: float = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        start = t_next = loop.time()
        while True:
            t_next += self.step_s
            delay = t_next - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                t_next = loop.time()
                await asyncio.sleep(0)
            for engine in self.engines:
                if engine.busy:
                    engine.tick()
            self.ticks += 1
            self.elapsed_s = loop.time() - start


async def serve(args: argparse.Namespace) -> None:
    step_s = args.max_batch / args.tokens_per_s
    engines, servicers, servers, ports = [], [], [], []
    for i in range(args.replicas):
        engine = SimEngine(args.max_batch, args.prefill_steps)
        servicer = SimInference(engine, SampleBank(args.seed + i), args.eos_prob, args.seed + 1000 + i)
        server = grpc.aio.server(options=GRPC_OPTIONS)
        pb_grpc.add_InferenceServiceServicer_to_server(servicer, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        engines.append(engine)
        servicers.append(servicer)
        servers.append(server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    clock = Clock(engines, step_s)
    ticking = asyncio.create_task(clock.run())
    print(json.dumps({"ports": ports, "step_s": step_s}), flush=True)
    await stop.wait()
    ticking.cancel()
    await asyncio.gather(*(s.stop(0) for s in servers))
    nominal = clock.ticks * step_s
    print(
        json.dumps(
            {
                "ticks": clock.ticks,
                "elapsed_s": round(clock.elapsed_s, 3),
                "step_ratio": round(nominal / clock.elapsed_s, 3) if clock.elapsed_s else 1.0,
                "requests": sum(s.requests for s in servicers),
                "samples": sum(s.samples for s in servicers),
            }
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--tokens-per-s", type=float, default=2791.0, help="a replica's decode tokens/s, batch full")
    ap.add_argument("--max-batch", type=int, default=64, help="sequences decoded at once per replica")
    ap.add_argument("--prefill-steps", type=int, default=1, help="decode steps a request spends in prefill")
    ap.add_argument("--eos-prob", type=float, default=0.5, help="probability a sample ends before max_new_tokens")
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
