"""The inference gRPC service: generation, weight updates (streamed or shared path, probe-verified), status."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from relayrl.common.control import require_token
from relayrl.common.grpc_utils import ServerHandle, create_server
from relayrl.common.logging import bind_log_context
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.probe import check_probe
from relayrl.common.weights import StaleVersionError, WeightAssembler, WeightUpdateError, read_shared
from relayrl.config.tls import TlsConfig
from relayrl.inference.engine import GenerationInput
from relayrl.inference.serving import InferenceService, LimitExceeded

log = logging.getLogger(__name__)


async def generation_input(service: InferenceService, request: pb.GenerateRequest) -> GenerationInput:
    """The engine's input for a gRPC request; ValueError for a malformed one."""
    kind = request.WhichOneof("prompt")
    if kind == "prompt_text":
        ids = await asyncio.to_thread(service.tokenize, request.prompt_text)  # CPU work: off the event loop
    elif kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
    else:
        raise ValueError("one of prompt_text or prompt_token_ids is required")
    s = request.sampling
    return service.check(GenerationInput(
        prompt_ids=ids, n=s.n or 1, temperature=s.temperature if s.temperature != 0 else 1.0,
        top_p=s.top_p if s.top_p != 0 else 1.0, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
        stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), seed=s.seed if s.HasField("seed") else None,
        ignore_eos=s.ignore_eos,
    ))


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, service: InferenceService) -> None:
        self.service = service

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        try:
            inp = await generation_input(self.service, request)
            submitted = self.service.submit(inp)
        except ValueError as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(exc, LimitExceeded) \
                else grpc.StatusCode.INVALID_ARGUMENT
            self.service.metrics.request_errors.labels("grpc", code.name).inc()
            await context.abort(code, str(exc))
        samples = await self.service.result(submitted, "grpc")
        return pb.GenerateResponse(
            request_id=request.request_id,
            prompt_token_ids=inp.prompt_ids,
            samples=[pb.Sample(token_ids=s.token_ids, logprobs=s.logprobs, weight_versions=s.weight_versions,
                               finish_reason=s.finish_reason, text=s.text) for s in samples],
        )

    async def _receive(self, request_iterator: AsyncIterator[pb.WeightUpdateMessage]
                       ) -> tuple[pb.WeightManifest, WeightAssembler]:
        engine = self.service.engine
        assembler = WeightAssembler(engine.specs)
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
        if manifest.version <= engine.version:
            raise StaleVersionError(f"version {manifest.version} is not newer than the served version "
                                    f"{engine.version}")
        if manifest.path and assembler.bytes_received:
            raise WeightUpdateError("an update is either streamed in chunks or read from a shared path, not both")
        try:
            check_probe([list(p.ids) for p in manifest.probe]) if manifest.probe else None
        except ValueError as exc:
            raise WeightUpdateError(str(exc)) from exc
        return manifest, assembler

    async def UpdateWeights(self, request_iterator: AsyncIterator[pb.WeightUpdateMessage],
                            context: grpc.aio.ServicerContext) -> pb.UpdateWeightsResponse:
        """Validate the whole update, swap atomically between decode steps, score the probe; on error nothing
        changes."""
        service, metrics = self.service, self.service.metrics
        await require_token(context, service.weights_token, "a weight update")  # only the trainer holds it
        async with service.update_lock:
            t0 = time.perf_counter()
            try:
                manifest, assembler = await self._receive(request_iterator)
                bind_log_context(weight_version=manifest.version)  # the rest of this call (its own task)
                if manifest.path:
                    if service.weights_dir is None:
                        raise WeightUpdateError("this server accepts no shared-path updates (no weights directory)")
                    tensors = await asyncio.to_thread(read_shared, manifest, service.weights_dir,
                                                      service.engine.specs)
                    nbytes = manifest.total_bytes
                else:
                    tensors = assembler.finish(manifest)
                    nbytes = assembler.bytes_received
                probe = [list(p.ids) for p in manifest.probe]
                probe_lp = await service.apply_update(tensors, manifest.version, probe)
            except StaleVersionError as exc:
                metrics.weight_updates.labels("stale").inc()
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except WeightUpdateError as exc:
                log.warning("refused weight update: %s", exc)
                metrics.weight_updates.labels("refused").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"weight update refused: {exc}")
            elapsed = time.perf_counter() - t0
            service.weight_updates += 1
            metrics.weight_updates.labels("applied").inc()
            metrics.weight_update_seconds.observe(elapsed)
            metrics.weight_update_bytes.inc(nbytes)
            return pb.UpdateWeightsResponse(version=manifest.version, apply_s=elapsed, bytes_received=nbytes,
                                            probe_logprobs=probe_lp)

    async def GetStatus(self, request: pb.GetInferenceStatusRequest,
                        context: grpc.aio.ServicerContext) -> pb.InferenceStatus:
        s = self.service
        stats = s.engine.stats()
        return pb.InferenceStatus(
            component=s.header.message(), weight_version=s.engine.version, model_path=s.model_path,
            requests_served=s.requests_served, tokens_generated=s.tokens_generated,
            requests_running=stats.running_requests, weight_updates=s.weight_updates,
            requests_queued=stats.queued_requests, sequences_running=stats.running_sequences,
            engine=s.cfg.engine.value,
        )


def create_inference_server(service: InferenceService,
                            tls: TlsConfig | None = None) -> tuple[ServerHandle, InferenceServicer]:
    """Build the gRPC server (not started); TLS when ``tls`` is on."""
    servicer = InferenceServicer(service)
    handle = create_server(
        service.cfg.server,
        [lambda s: pb_grpc.add_InferenceServiceServicer_to_server(servicer, s)],
        [pb.DESCRIPTOR.services_by_name["InferenceService"].full_name],
        tls,
    )
    return handle, servicer
