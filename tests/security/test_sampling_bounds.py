"""Sampling parameters are finite and bounded, by one validator for gRPC and REST (relayrl.inference.
sampling_limits): NaN, +/-Infinity, negative, tiny and huge temperatures, top_p and top_k outside their ranges are
refused before the engine sees them, INVALID_ARGUMENT over gRPC (Generate, GenerateBatch, GenerateStream) and an
OpenAI-shaped 400 naming the field over REST (completions and chat, streamed or not); one GenerateBatch asks for at
most max_samples_per_request samples, refused with RESOURCE_EXHAUSTED before anything is tokenised or queued."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from fastapi.testclient import TestClient

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.config.control import ControlConfig
from relayrl.config.inference import InferenceConfig
from relayrl.config.model import ModelConfig
from relayrl.inference.http_app import create_app
from relayrl.inference.native import NativeEngine
from relayrl.inference.serving import InferenceService
from tests.integration.helpers import inference_server

pytestmark = [pytest.mark.security, pytest.mark.integration]

# (field, value): each refused on its own; 1e-45 is a float32 subnormal (logits / it overflow to inf: NaN
# probabilities), 2**32 - 1 a top_k far over the vocabulary
BAD_GRPC = [
    ("temperature", math.inf),
    ("temperature", -math.inf),
    ("temperature", math.nan),
    ("temperature", -1.0),
    ("temperature", 1e6),
    ("temperature", 1e-45),
    ("top_p", math.inf),
    ("top_p", math.nan),
    ("top_k", 2**32 - 1),
]


class _Spy:
    """Counts what reaches the wrapped object's ``method`` (the engine's submit, the tokenizer's call)."""

    def __init__(self, inner: Any, method: str) -> None:
        self.inner, self.method, self.calls = inner, method, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return attr(*args, **kwargs)

        return counted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)


def _request(**sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id="r", prompt_text="1+2=", sampling=pb.SamplingParams(**{"n": 1, "max_new_tokens": 2, **sampling})
    )


async def _refusal(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("rpc", ["Generate", "GenerateBatch", "GenerateStream"])
async def test_non_finite_or_out_of_range_sampling_over_grpc_is_invalid_argument_naming_the_field(
    tiny_model_dir: Path, rpc: str
) -> None:
    async def go() -> tuple[list[tuple[str, Any, grpc.StatusCode, str]], int, int]:
        async with inference_server(tiny_model_dir) as (target, service), insecure_channel(target) as channel:
            engine = service.engine = _Spy(service.engine, "submit")  # type: ignore[assignment]
            stub = pb_grpc.InferenceServiceStub(channel)
            got = []
            for name, value in BAD_GRPC:
                bad = _request(**{name: value})
                call = {
                    "Generate": lambda b=bad: stub.Generate(b, timeout=30),
                    "GenerateBatch": lambda b=bad: stub.GenerateBatch(
                        pb.GenerateBatchRequest(requests=[_request(), b]), timeout=30
                    ),
                    "GenerateStream": lambda b=bad: stub.GenerateStream(b, timeout=30),
                }[rpc]
                got.append((name, value, *await _refusal(call)))
            refused_submits = engine.calls
            ok = await stub.Generate(_request(), timeout=30)  # the service serves on
            return got, refused_submits, len(ok.samples)

    got, submits, ok = await go()

    for name, value, code, details in got:
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (name, value, code)
        assert details.startswith(f"{name}="), (name, value, details)
    assert submits == 0 and ok == 1  # nothing refused reached the engine (GenerateBatch: its good request neither)


async def test_generate_batch_over_max_samples_per_request_is_resource_exhausted_before_tokenising_or_queueing(
    tiny_model_dir: Path,
) -> None:
    async def go() -> tuple[list[tuple[grpc.StatusCode, str]], int, int, int]:
        async with inference_server(tiny_model_dir) as (target, service), insecure_channel(target) as channel:
            engine = service.engine = _Spy(service.engine, "submit")  # type: ignore[assignment]
            tokenizer = service.tokenizer = _Spy(service.tokenizer, "__call__")
            stub = pb_grpc.InferenceServiceStub(channel)
            many = pb.GenerateBatchRequest(requests=[_request() for _ in range(300)])  # 300 x n=1, limit 256
            wide = pb.GenerateBatchRequest(requests=[_request(n=200), _request(n=200)])  # 2 x 200 samples
            got = [await _refusal(lambda r=r: stub.GenerateBatch(r, timeout=60)) for r in (many, wide)]
            refused = (engine.calls, tokenizer.calls)
            ok = await stub.GenerateBatch(pb.GenerateBatchRequest(requests=[_request(), _request(n=3)]), timeout=60)
            return got, *refused, sum(len(r.samples) for r in ok.responses)

    got, submits, tokenised, ok = await go()

    for code, details in got:
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "max_samples_per_request=256" in details
    assert submits == 0 and tokenised == 0  # refused before any request was tokenised or reached the engine
    assert ok == 4


@pytest.fixture(scope="module")
def chat_service(chat_model_dir: Path) -> Iterator[InferenceService]:
    """A real native engine over the chat model (it has a chat template), small limits."""
    defaults = InferenceConfig()
    cfg = InferenceConfig(
        max_new_tokens_limit=4, max_samples_per_request=4, http=replace(defaults.http, host="127.0.0.1", port=0)
    )
    tokenizer = load_tokenizer(chat_model_dir)
    engine = NativeEngine(
        load_model(ModelConfig(path=chat_model_dir)), tokenizer, torch.device("cpu"), max_batch_sequences=8
    )
    yield InferenceService(
        cfg, engine, tokenizer, str(chat_model_dir), weights_token=ControlConfig().effective_weights_token()
    )
    engine.close()


# JSON text as a client may send it: Python's json (FastAPI's reader) takes Infinity, -Infinity and NaN
BAD_REST = [
    ("temperature", "Infinity"),
    ("temperature", "-Infinity"),
    ("temperature", "NaN"),
    ("temperature", "-1"),
    ("temperature", "1e6"),
    ("temperature", "1e-45"),
    ("top_p", "Infinity"),
    ("top_p", "NaN"),
    ("top_k", "1000000000000000000000000000000"),
    ("frequency_penalty", "NaN"),
    ("presence_penalty", "Infinity"),
    ("max_tokens", "0"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_non_finite_or_out_of_range_sampling_over_rest_is_a_400_naming_the_field(
    chat_service: InferenceService, route: str, stream: bool
) -> None:
    prompt = '"prompt": "hi"' if route == "/v1/completions" else '"messages": [{"role": "user", "content": "hi"}]'
    spy = _Spy(chat_service.engine, "submit")
    real, chat_service.engine = chat_service.engine, spy  # type: ignore[assignment]
    try:
        with TestClient(create_app(chat_service), raise_server_exceptions=False) as client:
            answers = [
                (
                    name,
                    client.post(
                        route,
                        headers={"content-type": "application/json"},
                        content=(f'{{{prompt}, "max_tokens": 2, "stream": {str(stream).lower()}, "{name}": {value}}}'),
                    ),
                )
                for name, value in BAD_REST
            ]
            ok = client.post(
                route,
                json={
                    **(
                        {"prompt": "hi"}
                        if route == "/v1/completions"
                        else {"messages": [{"role": "user", "content": "hi"}]}
                    ),
                    "max_tokens": 2,
                },
            )
    finally:
        chat_service.engine = real

    for name, response in answers:
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["param"] == name and error["type"] == "invalid_request_error", error
        assert error["message"].startswith(f"{name}="), error
    assert spy.calls == 1 and ok.status_code == 200  # only the good request reached the engine
