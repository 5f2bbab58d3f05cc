"""Inference's GenerateBatch over a real gRPC server (tiny model, port 0): one response per request, each what
Generate answers; a request Generate would refuse refuses the whole call, and nothing of it keeps running."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from relayrl.client import InferenceClient, generate_request
from relayrl.common.pb import inference_pb2 as pb
from tests.integration.helpers import inference_server
from tests.polling import until

pytestmark = pytest.mark.integration
GREEDY = pb.SamplingParams(n=2, temperature=1.0, top_k=1, max_new_tokens=6, ignore_eos=True)


async def test_a_batch_answers_each_request_in_order_as_generate_does(tiny_model_dir: Path) -> None:
    async def go() -> tuple[Any, list[Any]]:
        async with inference_server(tiny_model_dir) as (target, _), InferenceClient(target) as client:
            prompts = ["1+2=", "3+4=5", "2+2="]
            batch = await client.generate_batch(
                [generate_request(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(prompts)], timeout_s=60
            )
            alone = [await client.generate(p, GREEDY, timeout_s=60) for p in prompts]
            return batch, alone

    batch, alone = await go()

    assert [r.request_id for r in batch.responses] == ["r0", "r1", "r2"]
    for got, want in zip(batch.responses, alone, strict=True):
        assert list(got.prompt_token_ids) == list(want.prompt_token_ids)
        assert len(got.samples) == 2 and all(len(s.token_ids) == 6 for s in got.samples)
        assert all(list(s.weight_versions) == [0] * 6 for s in got.samples)  # every token stamped
        # greedy decoding: the same tokens whether the request shared the engine's batch or ran alone
        assert [list(s.token_ids) for s in got.samples] == [list(s.token_ids) for s in want.samples]


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (
            pb.SamplingParams(n=1000, max_new_tokens=4),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),  # over max_samples_per_request
        (pb.SamplingParams(n=1, max_new_tokens=4, temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_one_refused_request_refuses_the_whole_batch_and_leaves_nothing_running(
    tiny_model_dir: Path, bad: pb.SamplingParams, code: grpc.StatusCode
) -> None:
    async def go() -> tuple[grpc.StatusCode, bool, int, int, pb.GenerateResponse]:
        async with inference_server(tiny_model_dir) as (target, service), InferenceClient(target, retries=1) as client:
            requests = [
                generate_request("1+2=", pb.SamplingParams(n=4, max_new_tokens=200, ignore_eos=True)),
                generate_request("3+4=", bad),
            ]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate_batch(requests, timeout_s=60)
            after = await client.generate("1+2=", GREEDY, timeout_s=60)  # the engine serves on
            # the engine lists a finished request's rows until its step ends: wait for that, not for the 200 tokens
            idle = await until(lambda: service.engine.stats().running_requests == 0)
            return err.value.code(), idle, service.requests_served, service.engine.stats().decode_steps, after

    got, idle, served, steps, after = await go()

    assert got == code
    assert idle and served == 1  # the first request was cancelled, never answered; the later one was
    assert steps < 100  # its 200 tokens were never sampled: the engine ran only the later request's few steps
    assert len(after.samples) == 2


async def test_a_streamed_batch_answers_each_request_as_its_samples_end_short_ones_first(tiny_model_dir: Path) -> None:
    """GenerateBatchStream: the same answers as GenerateBatch, each sent once its own samples ended, so a request
    of 2 tokens arrives before one of 60 that the engine runs beside it."""
    lengths = [60, 2, 30]
    requests = [
        generate_request("1+2=", pb.SamplingParams(n=2, temperature=1.0, top_k=1, max_new_tokens=n, ignore_eos=True))
        for n in lengths
    ]
    async with inference_server(tiny_model_dir) as (target, _), InferenceClient(target) as client:
        items = [item async for item in client.generate_batch_stream(requests, timeout_s=60)]
        batch = await client.generate_batch(requests, timeout_s=60)

    assert [item.index for item in items] == [1, 2, 0]  # in the order they ended: the shortest first
    for item in items:
        want = batch.responses[item.index]  # greedy: the same tokens as the unstreamed batch
        assert [list(s.token_ids) for s in item.response.samples] == [list(s.token_ids) for s in want.samples]
        assert all(len(s.token_ids) == lengths[item.index] for s in item.response.samples)


async def test_a_streamed_batch_with_a_refused_request_is_refused_before_any_answer(tiny_model_dir: Path) -> None:
    requests = [
        generate_request("1+2=", GREEDY),
        generate_request("3+4=", pb.SamplingParams(n=1, max_new_tokens=4, temperature=-1.0)),
    ]
    async with inference_server(tiny_model_dir) as (target, service), InferenceClient(target) as client:
        answers = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for item in client.generate_batch_stream(requests, timeout_s=60):
                answers.append(item)

    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and answers == [] and service.requests_served == 0
