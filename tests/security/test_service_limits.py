"""Every input has an explicit limit sized to the service's need: over it, a clean RESOURCE_EXHAUSTED / 413 (429 for
a full queue) at once, before the work it would cost (tokenising, buffering, queueing)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.config.inference import InferenceConfig
from relayrl.inference.engine import EngineStats, GenerationInput
from relayrl.inference.serving import InferenceService, LimitExceeded
from tests.conftest import WEIGHTS_TOKEN
from tests.integration.helpers import inference_server

pytestmark = [pytest.mark.security, pytest.mark.integration]

MIB = 1024 * 1024


class _CountingTokenizer:
    """The real tokenizer, counting how often it is asked to tokenise."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _generate(text: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r", prompt_text=text, sampling=pb.SamplingParams(n=1, max_new_tokens=1))


async def test_prompt_over_max_prompt_chars_is_resource_exhausted_before_tokenising(tiny_model_dir: Path) -> None:
    async def go() -> tuple[grpc.StatusCode, int]:
        async with inference_server(tiny_model_dir) as (target, service):
            spy = _CountingTokenizer(service.tokenizer)
            service.tokenizer = spy
            async with insecure_channel(target) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb_grpc.InferenceServiceStub(channel).Generate(_generate("1" * (5 * MIB)), timeout=30)
            return err.value.code(), spy.calls

    code, tokenised = await go()

    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert tokenised == 0


async def test_grpc_message_over_the_services_receive_limit_is_refused_and_the_server_keeps_serving(
    tiny_model_dir: Path,
) -> None:
    async def go() -> tuple[grpc.StatusCode, int]:
        async with inference_server(tiny_model_dir) as (target, _), insecure_channel(target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(_generate("1" * (9 * MIB)), timeout=30)  # limit: 8 MiB
            ok = await stub.Generate(_generate("1+2="), timeout=30)
            return err.value.code(), len(ok.samples)

    code, samples = await go()

    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert samples == 1


async def test_authenticated_call_beyond_max_authenticated_rpcs_is_refused_at_once_and_status_still_answers(
    tiny_model_dir: Path,
) -> None:
    async def go() -> tuple[grpc.StatusCode, str, int]:
        release = asyncio.Event()

        async def held_open() -> AsyncIterator[pb.WeightUpdateMessage]:
            await release.wait()  # a weight stream that stays open: the one call the server may run
            return
            yield

        async with (
            inference_server(tiny_model_dir, weights_limits={"max_authenticated_rpcs": 1}) as (_, service),
            insecure_channel(service.weights_target) as channel,
        ):
            stub = pb_grpc.InferenceServiceStub(channel)
            first = stub.UpdateWeights(
                held_open(),
                timeout=30,  # with the weights token: it stays open
                metadata=(("authorization", f"Bearer {WEIGHTS_TOKEN}"),),
            )
            for _ in range(3000):  # until the server runs it: its handler counts the open weight stream
                if service.weight_streams:
                    break
                await asyncio.sleep(0.01)
            assert service.weight_streams == 1
            with pytest.raises(grpc.aio.AioRpcError) as err:  # a second update: over the budget of one
                await stub.UpdateWeights(
                    held_open(), timeout=30, metadata=(("authorization", f"Bearer {WEIGHTS_TOKEN}"),)
                )
            status = await stub.GetStatus(pb.GetInferenceStatusRequest(), timeout=30)  # another budget
            release.set()
            with pytest.raises(grpc.aio.AioRpcError):
                await first  # ends without a manifest: refused, as before
            return err.value.code(), err.value.details() or "", int(status.weight_version)

    code, details, version = await go()

    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "inference.weights_server.max_authenticated_rpcs" in details
    assert version == 0


async def _post_raw(port: int, declared: int | None, body_bytes: int) -> tuple[int, bytes, int]:
    """POST /v1/completions over a raw socket: ``declared`` as Content-Length (None: chunked), then up to
    ``body_bytes`` of body, stopping as soon as the server has answered. Returns (status, response, bytes sent)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    framing = f"content-length: {declared}" if declared is not None else "transfer-encoding: chunked"
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"{framing}\r\n\r\n".encode()
    )
    sent = 0
    answer = asyncio.ensure_future(reader.read(65536))
    try:
        while sent < body_bytes and not answer.done():
            piece = b"1" * MIB
            writer.write(piece if declared is not None else f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            await writer.drain()
            sent += len(piece)
            await asyncio.sleep(0)
    except ConnectionError:
        pass  # the server answered and closed while we were still sending
    response = await asyncio.wait_for(answer, 30)
    writer.close()
    return int(response.split(b" ", 2)[1]), response, sent


@pytest.mark.parametrize("chunked", [False, True])
async def test_rest_body_over_the_limit_is_413_before_it_is_read_whole(tiny_model_dir: Path, chunked: bool) -> None:
    async def go() -> tuple[int, bytes, int, int]:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            port = service.http_port  # type: ignore[attr-defined]
            declared = None if chunked else 64 * MIB  # limit: 8 MiB
            status, response, sent = await _post_raw(port, declared, 64 * MIB)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                ok = await http.post("/v1/completions", json={"prompt": "1+2=", "max_tokens": 1})
            return status, response, sent, ok.status_code

    status, response, sent, after = await go()

    assert status == 413
    assert b"body_too_large" in response
    assert sent < 64 * MIB  # refused long before the whole body arrived
    assert after == 200


async def test_many_prompts_times_n_over_the_per_request_limit_is_413(tiny_model_dir: Path) -> None:
    async def go() -> int:
        async with inference_server(tiny_model_dir, http=True, max_samples_per_request=8) as (_, service):
            base = f"http://127.0.0.1:{service.http_port}"  # type: ignore[attr-defined]
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                resp = await http.post("/v1/completions", json={"prompt": ["1+2="] * 3, "n": 3, "max_tokens": 1})
            return resp.status_code

    assert await go() == 413


class _BusyEngine:
    """An engine whose queue is full (only what InferenceService.submit consults)."""

    version = 0
    vocab_size = 100

    def __init__(self, queued: int) -> None:
        self.queued = queued
        self.submitted = 0

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, self.queued, 0)

    def submit(self, inp: GenerationInput) -> Any:
        self.submitted += 1
        raise AssertionError("a full queue must refuse before the engine sees the request")


def test_request_when_the_engine_queue_is_full_is_refused_with_429_and_not_queued() -> None:
    engine = _BusyEngine(queued=4)
    service = InferenceService(
        InferenceConfig(max_queued_requests=4),
        engine,
        tokenizer=None,  # type: ignore[arg-type]
        model_path="m",
    )

    with pytest.raises(LimitExceeded) as err:
        service.submit(GenerationInput(prompt_ids=[1, 2], n=1, max_new_tokens=1))

    assert err.value.http_status == 429
    assert engine.submitted == 0


async def test_generate_with_n_over_max_samples_per_request_is_resource_exhausted(tiny_model_dir: Path) -> None:
    async def go() -> tuple[grpc.StatusCode, str]:
        async with inference_server(tiny_model_dir) as (target, _), insecure_channel(target) as channel:
            request = pb.GenerateRequest(prompt_text="1+2=", sampling=pb.SamplingParams(n=100_000, max_new_tokens=1))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.InferenceServiceStub(channel).Generate(request, timeout=30)
            return err.value.code(), err.value.details() or ""

    code, details = await go()

    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_samples_per_request" in details
