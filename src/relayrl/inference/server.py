"""The inference gRPC service: generation and status on ``inference.server``; weight updates (streamed or shared
path, probe-verified) and status on their own ``inference.weights_server``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, NoReturn

import grpc
from torch import Tensor

from relayrl.common.collective_weights import receive_update
from relayrl.common.control import require_token
from relayrl.common.grpc_admission import ADMITTED, method_path
from relayrl.common.grpc_utils import ServerHandle, create_server
from relayrl.common.logging import bind_log_context
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.probe import check_probe
from relayrl.common.weights import StaleVersionError, WeightAssembler, WeightUpdateError, check_finite, read_shared
from relayrl.config.tls import TlsConfig
from relayrl.inference.engine import GenerationInput
from relayrl.inference.sampling_limits import check_samples
from relayrl.inference.server_convert import generate_response, generation_input, sample_message, score_inputs
from relayrl.inference.serving import InferenceService, LimitExceeded, WeightSwapError
from relayrl.inference.token_stream import Event, Submitted, events, feed

log = logging.getLogger(__name__)


class IdleStreamError(Exception):
    """A weight stream that sent nothing for weights_idle_timeout_s."""


# refusal -> (status code, metrics label); any other WeightUpdateError is INVALID_ARGUMENT
_REFUSALS: dict[type[Exception], tuple[grpc.StatusCode, str]] = {
    StaleVersionError: (grpc.StatusCode.FAILED_PRECONDITION, "stale"),
    IdleStreamError: (grpc.StatusCode.DEADLINE_EXCEEDED, "idle"),
    WeightSwapError: (grpc.StatusCode.FAILED_PRECONDITION, "swap_failed"),
}


def served_check(engine: Any, sha256: str) -> dict[str, str]:
    """The response's served-weights fields: the manifest's checksum when the engine confirmed that its modules read
    the update's tensors, the offending module path when one does not, nothing when the engine cannot tell."""
    mismatch = getattr(engine, "last_served_mismatch", None)
    if mismatch is None:
        return {}
    return {"served_mismatch": mismatch} if mismatch else {"served_sha256": sha256}


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """One servicer class for both ports: the main one (``weights_port`` False) serves Generate (and its batch and
    stream forms) and GetStatus and refuses UpdateWeights; the weights one serves UpdateWeights and GetStatus and
    refuses Generate."""

    def __init__(self, service: InferenceService, weights_port: bool = False) -> None:
        self.service = service
        self.weights_port = weights_port

    async def _refuse_request(self, context: grpc.aio.ServicerContext, exc: ValueError) -> NoReturn:
        """Abort a refused generation call: RESOURCE_EXHAUSTED over a limit, else INVALID_ARGUMENT."""
        code = (
            grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(exc, LimitExceeded) else grpc.StatusCode.INVALID_ARGUMENT
        )
        self.service.metrics.request_errors.labels("grpc", code.name).inc()
        await context.abort(code, str(exc))
        raise AssertionError("unreachable: abort raises") from exc

    async def _generation_port(self, context: grpc.aio.ServicerContext) -> None:
        if self.weights_port:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "generation is served on inference.server, not on the weights port"
            )

    async def _submit(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, stream: bool
    ) -> tuple[GenerationInput, Submitted, asyncio.Queue[Event] | None]:
        """Check and submit a Generate(Stream) request (with ``stream``, its tokens fed to a queue); a refused one
        aborts the call (RESOURCE_EXHAUSTED over a limit, else INVALID_ARGUMENT)."""
        await self._generation_port(context)
        try:
            inp = await generation_input(self.service, request)
            queue = feed([inp]) if stream else None
            return inp, self.service.submit(inp), queue
        except ValueError as exc:
            await self._refuse_request(context, exc)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        inp, submitted, _ = await self._submit(request, context, stream=False)
        samples = await self.service.result(submitted, "grpc")
        return pb.GenerateResponse(
            request_id=request.request_id, prompt_token_ids=inp.prompt_ids, samples=[sample_message(s) for s in samples]
        )

    async def GenerateBatch(
        self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateBatchResponse:
        """Generate for each request (see :meth:`_submit_batch`), answered once all are done."""
        inputs, submitted = await self._submit_batch(request, context)
        outputs = await asyncio.gather(*(self.service.result(sub, "grpc_batch") for sub in submitted))
        return pb.GenerateBatchResponse(
            responses=[
                generate_response(r, inp, samples)
                for r, inp, samples in zip(request.requests, inputs, outputs, strict=True)
            ]
        )

    async def GenerateBatchStream(
        self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateBatchItem]:
        """Generate for each request (see :meth:`_submit_batch`), each answered as soon as its samples end; the
        requests still running when the call ends (cancelled, deadline) are cancelled in the engine."""
        inputs, submitted = await self._submit_batch(request, context)

        async def one(i: int) -> tuple[int, list[Any]]:
            return i, await self.service.result(submitted[i], "grpc_batch")

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(submitted))]
        try:
            for next_done in asyncio.as_completed(tasks):
                i, samples = await next_done
                yield pb.GenerateBatchItem(index=i, response=generate_response(request.requests[i], inputs[i], samples))
        finally:
            for task in tasks:
                task.cancel()
            for future, _t0 in submitted:
                future.cancel()

    async def _submit_batch(
        self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> tuple[list[Any], list[Submitted]]:
        """Check and submit every request of a batch: the call's samples (the requests' n summed) within
        max_samples_per_request (else RESOURCE_EXHAUSTED before anything is tokenised), every request checked, then
        all submitted before any is awaited (the engine admits them together). A refused request refuses the call;
        nothing of a refused call stays queued."""
        await self._generation_port(context)
        submitted: list[Submitted] = []
        try:
            check_samples(
                [r.sampling.n or 1 for r in request.requests],
                self.service.cfg,
                f"the {len(request.requests)} requests of this GenerateBatch",
            )
            inputs = [await generation_input(self.service, r) for r in request.requests]
            for inp in inputs:
                submitted.append(self.service.submit(inp))
        except ValueError as exc:
            for future, _t0 in submitted:
                future.cancel()
            await self._refuse_request(context, exc)
        except BaseException:
            for future, _t0 in submitted:
                future.cancel()
            raise
        return inputs, submitted

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        """Generate, streamed (see GenerateChunk): the shared engine-to-loop plumbing of the REST API's streaming
        (relayrl.inference.token_stream); a cancelled call closes this generator, which cancels the request."""
        inp, submitted, queue = await self._submit(request, context, stream=True)
        assert queue is not None
        rid = request.request_id
        yield pb.GenerateChunk(request_id=rid, prompt_token_ids=inp.prompt_ids)
        async for kind, _, item in events(self.service, queue, [submitted], "grpc_stream"):
            if kind == "token":
                yield pb.GenerateChunk(
                    request_id=rid,
                    index=item.index,
                    token_ids=[item.token_id],
                    logprobs=[item.logprob],
                    weight_versions=[item.version],
                )
            else:
                for index, s in enumerate(item):
                    yield pb.GenerateChunk(request_id=rid, index=index, sample=sample_message(s))

    async def ScoreTokens(
        self, request: pb.ScoreTokensRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreTokensResponse:
        """Logprobs of given completion tokens: each sequence runs as a one-token generation of prompt +
        completion that asks for its prompt logprobs (the engine batches them with other requests)."""
        if self.weights_port:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "scoring is served on inference.server")
        if not getattr(self.service.engine, "computes_alternatives", False):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this engine does not compute prompt logprobs")
        submitted: list[Submitted] = []
        try:
            for inp in score_inputs(self.service, request):
                submitted.append(self.service.submit(inp))
        except ValueError as exc:  # all or none: a refused one (a full queue) cancels those already queued
            for future, _t0 in submitted:
                future.cancel()
            await self._refuse_request(context, exc)
        outputs = await asyncio.gather(*(self.service.result(s, "grpc_score") for s in submitted))
        scores, version = [], 0
        for seq, samples in zip(request.sequences, outputs, strict=True):
            start = len(seq.prompt_token_ids)
            scores.append(pb.TokenLogprobs(logprobs=[float(lp or 0.0) for lp in samples[0].prompt_logprobs[start:]]))
            version = max(version, *samples[0].weight_versions)
        return pb.ScoreTokensResponse(request_id=request.request_id, scores=scores, weight_version=version)

    async def _messages(
        self, request_iterator: AsyncIterator[pb.WeightUpdateMessage]
    ) -> AsyncIterator[pb.WeightUpdateMessage]:
        """The stream's messages; IdleStreamError when none arrives within weights_idle_timeout_s."""
        timeout = self.service.cfg.weights_idle_timeout_s
        it = aiter(request_iterator)
        while True:
            try:
                msg = await asyncio.wait_for(anext(it), timeout)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise IdleStreamError(f"no message for {timeout:g}s (inference.weights_idle_timeout_s)") from None
            yield msg

    async def _receive(
        self, request_iterator: AsyncIterator[pb.WeightUpdateMessage]
    ) -> tuple[pb.WeightManifest, WeightAssembler]:
        """Every message of the stream, each chunk checked against the model's specs as it arrives, then the
        manifest's own checks (version, transport, probe): nothing here touches the served model."""
        engine = self.service.engine
        assembler = WeightAssembler(engine.specs)
        manifest: pb.WeightManifest | None = None
        async for msg in self._messages(request_iterator):
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
        if manifest.version <= engine.version:  # early; checked again under the update lock
            raise StaleVersionError(f"version {manifest.version} is not newer than the served version {engine.version}")
        if sum(map(bool, (manifest.path, assembler.bytes_received, manifest.HasField("collective")))) > 1:
            raise WeightUpdateError(
                "an update is streamed in chunks, read from a shared path or broadcast: one of them"
            )
        try:
            check_probe(
                [list(p.ids) for p in manifest.probe],
                engine.vocab_size,
                engine.context_length,
                self.service.cfg.max_probe_tokens,
            ) if manifest.probe else None
        except ValueError as exc:
            raise WeightUpdateError(str(exc)) from exc
        return manifest, assembler

    def _assemble(self, manifest: pb.WeightManifest, assembler: WeightAssembler) -> tuple[dict[str, Tensor], int]:
        """The update's tensors, complete and checked (checksum, finite values), and its size (blocking: runs off
        the event loop, outside the update lock)."""
        service = self.service
        if manifest.path:
            if service.weights_dir is None:
                raise WeightUpdateError("this server accepts no shared-path updates (no weights directory)")
            tensors, nbytes = read_shared(manifest, service.weights_dir, service.engine.specs), manifest.total_bytes
        elif manifest.HasField("collective"):
            tensors = receive_update(manifest, service.engine.specs)
            nbytes = manifest.total_bytes
        else:
            tensors, nbytes = assembler.finish(manifest), assembler.bytes_received
        check_finite(tensors)
        return tensors, nbytes

    async def _drain(self, request_iterator: AsyncIterator[pb.WeightUpdateMessage]) -> None:
        """Read and drop what is left of a refused update's stream until the pusher half-closes (each message, and
        all of them, within weights_idle_timeout_s), so that the refusal answers a pusher that no longer writes:
        grpc.aio turns a client's write that meets an ended call into INTERNAL and hides the refusal's code
        (grpc/grpc#36066). Only an admitted pusher, holding the weights token, gets here."""

        async def rest() -> None:
            async for _ in self._messages(request_iterator):
                pass

        with contextlib.suppress(IdleStreamError, TimeoutError):
            await asyncio.wait_for(rest(), self.service.cfg.weights_idle_timeout_s)

    async def _refuse(self, context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
        """Abort a refused update with its deliberate status code; nothing was changed."""
        code, label = _REFUSALS.get(type(exc), (grpc.StatusCode.INVALID_ARGUMENT, "refused"))
        log.warning("refused weight update (%s): %s", code.name, exc)
        self.service.metrics.weight_updates.labels(label).inc()
        await context.abort(code, f"weight update refused: {exc}")
        raise AssertionError("unreachable: abort raises")

    async def UpdateWeights(
        self, request_iterator: AsyncIterator[pb.WeightUpdateMessage], context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        """Receive, assemble and validate the whole update without the update lock; then, under it, re-check the
        version, swap between decode steps and score the probe. On any error the old weights and version serve."""
        service, metrics = self.service, self.service.metrics
        if not self.weights_port:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "weight updates are accepted only on the weights "
                f"port (inference.weights_server, {service.weights_target or 'see the config'})",
            )
        await require_token(context, service.weights_token, "a weight update")  # only the trainer holds it
        await context.send_initial_metadata((ADMITTED,))  # admitted: the pusher may stream now
        t0 = time.perf_counter()
        service.weight_streams += 1
        try:
            manifest, assembler = await self._receive(request_iterator)
            t_received = time.perf_counter()
            bind_log_context(weight_version=manifest.version)  # the rest of this call (its own task)
            tensors, nbytes = await asyncio.to_thread(self._assemble, manifest, assembler)
            del assembler  # its buffers now back ``tensors``
            t_assembled = time.perf_counter()
            probe_lp = await service.apply_update(tensors, manifest.version, [list(p.ids) for p in manifest.probe])
        except (WeightUpdateError, IdleStreamError, WeightSwapError) as exc:
            if not isinstance(exc, IdleStreamError):
                await self._drain(request_iterator)
            await self._refuse(context, exc)
        finally:
            service.weight_streams -= 1
        t_end = time.perf_counter()
        elapsed = t_end - t0
        probe_s = min(float(getattr(service.engine, "last_probe_s", 0.0)), t_end - t_assembled)
        service.weight_updates += 1
        metrics.weight_updates.labels("applied").inc()
        metrics.weight_update_seconds.observe(elapsed)
        metrics.weight_update_bytes.inc(nbytes)
        return pb.UpdateWeightsResponse(
            version=manifest.version,
            apply_s=elapsed,
            bytes_received=nbytes,
            probe_logprobs=probe_lp,
            receive_s=t_received - t0,
            assemble_s=t_assembled - t_received,
            swap_s=t_end - t_assembled - probe_s,
            probe_s=probe_s,
            **served_check(service.engine, manifest.sha256),
        )

    async def GetStatus(
        self, request: pb.GetInferenceStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.InferenceStatus:
        s = self.service
        stats = s.engine.stats()
        return pb.InferenceStatus(
            component=s.header.message(),
            weight_version=s.engine.version,
            model_path=s.model_path,
            requests_served=s.requests_served,
            tokens_generated=s.tokens_generated,
            requests_running=stats.running_requests,
            weight_updates=s.weight_updates,
            requests_queued=stats.queued_requests,
            sequences_running=stats.running_sequences,
            engine=s.cfg.engine.value,
        )


def _register(add: Callable[[Any, grpc.aio.Server], None], servicer: Any, server: grpc.aio.Server) -> None:
    add(servicer, server)


def create_inference_servers(
    service: InferenceService, tls: TlsConfig | None = None
) -> tuple[ServerHandle, ServerHandle]:
    """Build the main gRPC server (``inference.server``) and the weights server (``inference.weights_server``),
    both bound, not started, with TLS when ``tls`` is on. Records the weights server's target in
    ``service.weights_target``."""
    name = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
    add = pb_grpc.add_InferenceServiceServicer_to_server
    handles = []
    # the weights port admits UpdateWeights with the weights token only (its own budget); the main port refuses it
    weights_tokens: dict[str, Callable[[], str]] = {method_path(name, "UpdateWeights"): lambda: service.weights_token}
    for cfg, weights_port in ((service.cfg.server, False), (service.cfg.weights_server, True)):
        servicer = InferenceServicer(service, weights_port)
        handles.append(
            create_server(
                cfg,
                [functools.partial(_register, add, servicer)],
                [name],
                tls,
                tokens=weights_tokens if weights_port else None,
                section="inference.weights_server" if weights_port else "inference.server",
            )
        )
    ws = service.cfg.weights_server
    service.weights_target = ws.address or replace(ws, port=handles[1].port).target
    return handles[0], handles[1]
