"""The inference gRPC service: batched generation, streamed weight updates, status."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from relayrl.common.grpc_utils import ServerHandle, create_server
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.service import StatusHeader
from relayrl.common.weights import StaleVersionError, WeightAssembler, WeightUpdateError
from relayrl.inference.config import InferenceConfig
from relayrl.inference.engine import GenerationInput, NativeEngine, SampleOutput

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    inp: GenerationInput
    future: asyncio.Future[list[SampleOutput]]


class Batcher:
    """Collects concurrent requests into batches and runs them on one engine thread.

    Requests that arrive while a batch runs join the next one. A seeded request runs alone (reproducible).
    """

    def __init__(self, engine: NativeEngine, max_batch_sequences: int, batch_wait_s: float,
                 executor: ThreadPoolExecutor) -> None:
        self._engine = engine
        self._max = max_batch_sequences
        self._wait = batch_wait_s
        self._executor = executor
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.running = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def submit(self, inp: GenerationInput) -> list[SampleOutput]:
        fut: asyncio.Future[list[SampleOutput]] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(inp, fut))
        return await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        carry: _Pending | None = None
        while True:
            first = carry or await self._queue.get()
            carry = None
            batch = [first]
            if first.inp.seed is None:
                if self._wait > 0:
                    await asyncio.sleep(self._wait)
                size = first.inp.n
                while not self._queue.empty():
                    nxt = self._queue.get_nowait()
                    if nxt.inp.seed is not None or size + nxt.inp.n > self._max:
                        carry = nxt
                        break
                    batch.append(nxt)
                    size += nxt.inp.n
            live = [p for p in batch if not p.future.done()]
            if not live:
                continue
            self.running = len(live)
            try:
                results = await loop.run_in_executor(self._executor, self._engine.generate, [p.inp for p in live])
            except Exception as exc:  # an engine failure fails these requests, not the service
                log.exception("generation batch failed")
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(exc)
            else:
                for p, res in zip(live, results, strict=True):
                    if not p.future.done():
                        p.future.set_result(res)
            finally:
                self.running = 0


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, cfg: InferenceConfig, engine: NativeEngine, tokenizer: object, model_path: str,
                 executor: ThreadPoolExecutor) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.header = StatusHeader("inference")
        self.batcher = Batcher(engine, cfg.max_batch_sequences, cfg.batch_wait_ms / 1000.0, executor)
        self._executor = executor
        self._update_lock = asyncio.Lock()
        self.requests_served = 0
        self.tokens_generated = 0
        self.weight_updates = 0

    def _parse(self, request: pb.GenerateRequest) -> GenerationInput:
        cfg = self.cfg
        kind = request.WhichOneof("prompt")
        if kind == "prompt_text":
            if not request.prompt_text:
                raise ValueError("prompt_text is empty")
            ids = list(self.tokenizer(request.prompt_text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
        elif kind == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
        else:
            raise ValueError("one of prompt_text or prompt_token_ids is required")
        if not ids:
            raise ValueError("the prompt has no tokens")
        if len(ids) > cfg.max_prompt_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens, limit is {cfg.max_prompt_tokens}")
        vocab = self.engine.model.get_input_embeddings().num_embeddings
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        s = request.sampling
        n = s.n or 1
        if n > cfg.max_samples_per_request:
            raise ValueError(f"n={n} exceeds max_samples_per_request={cfg.max_samples_per_request}")
        temperature = s.temperature if s.temperature != 0 else 1.0
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        top_p = s.top_p if s.top_p != 0 else 1.0
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if s.max_new_tokens < 1 or s.max_new_tokens > cfg.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens must be in [1, {cfg.max_new_tokens_limit}], got {s.max_new_tokens}")
        if any(not stop for stop in s.stop):
            raise ValueError("stop strings must not be empty")
        return GenerationInput(
            prompt_ids=ids, n=n, temperature=temperature, top_p=top_p, top_k=s.top_k,
            max_new_tokens=s.max_new_tokens, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
            seed=s.seed if s.HasField("seed") else None, ignore_eos=s.ignore_eos,
        )

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        try:
            inp = self._parse(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        samples = await self.batcher.submit(inp)
        self.requests_served += 1
        self.tokens_generated += sum(len(s.token_ids) for s in samples)
        return pb.GenerateResponse(
            request_id=request.request_id,
            prompt_token_ids=inp.prompt_ids,
            samples=[pb.Sample(token_ids=s.token_ids, logprobs=s.logprobs, weight_versions=s.weight_versions,
                               finish_reason=s.finish_reason, text=s.text) for s in samples],
        )

    async def _receive(self, request_iterator: AsyncIterator[pb.WeightUpdateMessage]
                       ) -> tuple[pb.WeightManifest, WeightAssembler]:
        assembler = WeightAssembler(self.engine.specs)
        manifest: pb.WeightManifest | None = None
        async for msg in request_iterator:
            if manifest is not None:
                raise WeightUpdateError("messages after the manifest")
            if msg.HasField("chunk"):
                assembler.add(msg.chunk)
            elif msg.HasField("manifest"):
                manifest = msg.manifest
            else:
                raise WeightUpdateError("empty message in weight stream")
        if manifest is None:
            raise WeightUpdateError("the stream ended without a manifest")
        if manifest.version <= self.engine.version:
            raise StaleVersionError(f"version {manifest.version} is not newer than the served version "
                                    f"{self.engine.version}")
        return manifest, assembler

    async def UpdateWeights(self, request_iterator: AsyncIterator[pb.WeightUpdateMessage],
                            context: grpc.aio.ServicerContext) -> pb.UpdateWeightsResponse:
        """Validate the whole update, then swap atomically between decode steps; on error nothing changes."""
        async with self._update_lock:  # one update at a time
            t0 = time.perf_counter()
            try:
                manifest, assembler = await self._receive(request_iterator)
                tensors = assembler.finish(manifest)
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, self.engine.update_weights, tensors, manifest.version)
            except StaleVersionError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except WeightUpdateError as exc:
                log.warning("refused weight update: %s", exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"weight update refused: {exc}")
            self.weight_updates += 1
            return pb.UpdateWeightsResponse(version=manifest.version, apply_s=time.perf_counter() - t0,
                                            bytes_received=assembler.bytes_received)

    async def GetStatus(self, request: pb.GetInferenceStatusRequest,
                        context: grpc.aio.ServicerContext) -> pb.InferenceStatus:
        return pb.InferenceStatus(
            component=self.header.message(), weight_version=self.engine.version, model_path=self.model_path,
            requests_served=self.requests_served, tokens_generated=self.tokens_generated,
            requests_running=self.batcher.running, weight_updates=self.weight_updates,
        )


def create_inference_server(cfg: InferenceConfig, engine: NativeEngine, tokenizer: object,
                            model_path: str) -> tuple[ServerHandle, InferenceServicer]:
    """Build the server (not started). The caller starts the batcher and the server inside its loop."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    servicer = InferenceServicer(cfg, engine, tokenizer, model_path, executor)
    handle = create_server(
        cfg.server,
        [lambda s: pb_grpc.add_InferenceServiceServicer_to_server(servicer, s)],
        [pb.DESCRIPTOR.services_by_name["InferenceService"].full_name],
    )
    return handle, servicer
