"""The inference service over real gRPC on port 0."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relayrl.common.grpc_utils import MAX_MESSAGE_BYTES, insecure_channel
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.weights import iter_update_messages, model_tensors
from tests.conftest import WEIGHTS_TOKEN
from tests.integration.helpers import inference_server

AUTH = (("authorization", f"Bearer {WEIGHTS_TOKEN}"),)  # the weights token: what the trainer sends
pytestmark = pytest.mark.integration


def _request(**sampling: object) -> pb.GenerateRequest:
    params = {"n": 2, "max_new_tokens": 3, **sampling}
    return pb.GenerateRequest(prompt_text="1+2=", sampling=pb.SamplingParams(**params))  # type: ignore[arg-type]


async def _stream(messages: list[pb.WeightUpdateMessage]):  # type: ignore[no-untyped-def]
    for m in messages:
        yield m


async def test_generate_returns_n_samples_with_aligned_logprobs_and_versions(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir) as (target, _), insecure_channel(target) as ch:
            stub = pb_grpc.InferenceServiceStub(ch)
            resp = await stub.Generate(_request(n=3), timeout=30)
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)

            assert len(resp.samples) == 3
            assert list(resp.prompt_token_ids)  # tokenized by the server
            for s in resp.samples:
                assert len(s.token_ids) == len(s.logprobs) == len(s.weight_versions) >= 1
                assert set(s.weight_versions) == {0}
                assert all(lp <= 0 for lp in s.logprobs)
            assert health.status == health_pb2.HealthCheckResponse.SERVING

    await go()


async def test_concurrent_requests_are_batched_and_all_answered(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir) as (target, servicer), insecure_channel(target) as ch:
            stub = pb_grpc.InferenceServiceStub(ch)
            responses = await asyncio.gather(*(stub.Generate(_request(n=4), timeout=60) for _ in range(12)))

            assert [len(r.samples) for r in responses] == [4] * 12
            assert servicer.requests_served == 12

    await go()


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.GenerateRequest(sampling=pb.SamplingParams(n=1, max_new_tokens=2)), "prompt"),
        (_request(max_new_tokens=0), "max_new_tokens"),
        (_request(temperature=-1.0), "temperature"),
        (_request(top_p=1.5), "top_p"),
        (
            pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=[10**6]), sampling=pb.SamplingParams(n=1, max_new_tokens=2)
            ),
            "token ids",
        ),
        (
            pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=[3] * 250),  # the tiny model's context is 256
                sampling=pb.SamplingParams(n=1, max_new_tokens=10),
            ),
            "context length",
        ),
        (_request(max_new_tokens=5000), "max_new_tokens"),
        (_request(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
async def test_malformed_generate_is_invalid_argument(
    tiny_model_dir: Path, request_: pb.GenerateRequest, message: str
) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir) as (target, _), insecure_channel(target) as ch:
            stub = pb_grpc.InferenceServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(request_, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (info.value.details() or "")
            # the service survives bad input
            ok = await stub.Generate(_request(), timeout=30)
            assert len(ok.samples) == 2

    await go()


async def test_weight_update_swaps_weights_and_version(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with (
            inference_server(tiny_model_dir) as (target, servicer),
            insecure_channel(target) as ch,
            insecure_channel(servicer.weights_target) as wch,
        ):
            stub = pb_grpc.InferenceServiceStub(ch)
            wstub = pb_grpc.InferenceServiceStub(wch)
            new = {k: torch.randn_like(v) for k, v in model_tensors(servicer.engine.model).items()}

            resp = await wstub.UpdateWeights(
                _stream(list(iter_update_messages(new, 4, chunk_bytes=8192))), timeout=30, metadata=AUTH
            )
            status = await stub.GetStatus(pb.GetInferenceStatusRequest(), timeout=5)
            gen = await stub.Generate(_request(), timeout=30)

            assert resp.version == 4 and status.weight_version == 4
            assert all(set(s.weight_versions) == {4} for s in gen.samples)
            for k, v in model_tensors(servicer.engine.model).items():
                assert torch.equal(v, new[k])

    await go()


async def test_weight_update_with_bad_shape_is_refused_and_old_weights_keep_serving(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with (
            inference_server(tiny_model_dir) as (target, servicer),
            insecure_channel(target) as ch,
            insecure_channel(servicer.weights_target) as wch,
        ):
            stub = pb_grpc.InferenceServiceStub(ch)
            wstub = pb_grpc.InferenceServiceStub(wch)
            before = {k: v.clone() for k, v in model_tensors(servicer.engine.model).items()}
            bad = dict(before)
            name = next(iter(bad))
            bad[name] = torch.zeros(3, 3)
            unknown = {**before, "not.a.parameter": torch.zeros(2)}

            for tensors in (bad, unknown):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await wstub.UpdateWeights(
                        _stream(list(iter_update_messages(tensors, 1))), timeout=30, metadata=AUTH
                    )
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            assert servicer.engine.version == 0
            assert all(torch.equal(v, before[k]) for k, v in model_tensors(servicer.engine.model).items())
            assert len((await stub.Generate(_request(), timeout=30)).samples) == 2

    await go()


async def test_weight_update_not_newer_is_failed_precondition(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir) as (_, servicer), insecure_channel(servicer.weights_target) as wch:
            wstub = pb_grpc.InferenceServiceStub(wch)
            tensors = model_tensors(servicer.engine.model)
            await wstub.UpdateWeights(_stream(list(iter_update_messages(tensors, 2))), timeout=30, metadata=AUTH)

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await wstub.UpdateWeights(_stream(list(iter_update_messages(tensors, 2))), timeout=30, metadata=AUTH)

            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert servicer.engine.version == 2

    await go()


async def test_weight_stream_without_manifest_is_refused(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir) as (_, servicer), insecure_channel(servicer.weights_target) as wch:
            wstub = pb_grpc.InferenceServiceStub(wch)
            chunks = list(iter_update_messages(model_tensors(servicer.engine.model), 1))[:-1]

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await wstub.UpdateWeights(_stream(chunks), timeout=30, metadata=AUTH)

            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "manifest" in (info.value.details() or "")

    await go()


async def test_oversized_message_is_resource_exhausted_and_others_are_served(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir) as (target, _), insecure_channel(target) as ch:
            stub = pb_grpc.InferenceServiceStub(ch)
            huge = pb.GenerateRequest(
                prompt_text="1" * (MAX_MESSAGE_BYTES + 1), sampling=pb.SamplingParams(max_new_tokens=1)
            )

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(huge, timeout=30)

            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the receive limit
            assert len((await stub.Generate(_request(), timeout=30)).samples) == 2

    await go()
