"""Inference's GenerateStream over a real gRPC server (tiny model, port 0): tokens leave as they are sampled, add up
to the finished sample (and to Generate's under greedy decoding), and a call that goes away cancels its request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from relayrl.client import InferenceClient
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH
from tests.integration.helpers import held_engine, inference_server
from tests.polling import until

pytestmark = pytest.mark.integration
GREEDY = pb.SamplingParams(n=1, temperature=1.0, top_k=1, max_new_tokens=40, ignore_eos=True)


async def test_tokens_stream_while_the_engine_still_samples_and_add_up_to_the_sample_and_to_generate(
    tiny_model_dir: Path,
) -> None:
    async def go() -> dict[str, Any]:
        async with inference_server(tiny_model_dir) as (target, service), InferenceClient(target) as client:
            out: dict[str, Any] = {"ids": [], "lps": [], "versions": [], "samples": []}
            async with held_engine(service) as gate:
                call = client.generate_stream("1+2=", GREEDY, timeout_s=60, request_id="r1")
                async for chunk in call:
                    if chunk.token_ids and "running_at_first" not in out:
                        # the engine holds before its 4th step: the 40-token sample cannot finish (its row shows
                        # once admitted: the first token is sampled at prefill, before the row is listed)
                        out["running_at_first"] = await until(lambda: service.engine.stats().running_requests == 1)
                        out["served_at_first"] = service.requests_served
                        gate.set()
                    out.setdefault("first", chunk)
                    out["ids"] += chunk.token_ids
                    out["lps"] += chunk.logprobs
                    out["versions"] += chunk.weight_versions
                    if chunk.HasField("sample"):
                        out["samples"].append(chunk.sample)
            out["unary"] = await client.generate("1+2=", GREEDY, timeout_s=60)
            return out

    out = await go()

    assert out["running_at_first"] and out["served_at_first"] == 0
    first, [sample], unary = out["first"], out["samples"], out["unary"]
    assert first.request_id == "r1" and list(first.prompt_token_ids) == list(unary.prompt_token_ids)
    assert not first.token_ids  # the first chunk only acknowledges the prompt
    assert out["ids"] == list(sample.token_ids) == list(unary.samples[0].token_ids) and len(out["ids"]) == 40
    assert out["lps"] == list(sample.logprobs)  # the same float32 values, streamed then collected
    assert out["versions"] == list(sample.weight_versions) == [0] * 40
    assert sample.finish_reason == FINISH_REASON_LENGTH and sample.text == unary.samples[0].text
    # the same greedy tokens alone in the batch both times; float32 logits of one model: equal up to rounding
    assert list(sample.logprobs) == pytest.approx(list(unary.samples[0].logprobs), abs=1e-5)


@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_a_stream_that_goes_away_cancels_its_request_in_the_engine(tiny_model_dir: Path, how: str) -> None:
    async def go() -> dict[str, Any]:
        async with inference_server(tiny_model_dir) as (target, service), InferenceClient(target) as client:
            engine = service.engine
            async with held_engine(service) as gate:
                call = client.generate_stream("1+", GREEDY, timeout_s=60 if how == "cancel" else 3)
                async for chunk in call:
                    if chunk.token_ids:
                        break
                if how == "cancel":
                    call.cancel()
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as failed:
                        async for _ in call:
                            pass
                    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

                def cancelled() -> bool:  # held with the cancelled row, or already dropped it
                    rows = engine._rows
                    return engine.stats().cancelled_sequences == 1 or bool(rows and rows[0].req.future.cancelled())

                seen = await until(cancelled)
                gate.set()
                dropped = await until(lambda: engine.stats().running_sequences == 0)
            stats, served = engine.stats(), service.requests_served
            ok = await client.generate("1", pb.SamplingParams(n=1, max_new_tokens=2, ignore_eos=True), timeout_s=30)
            return {"seen": seen, "dropped": dropped, "stats": stats, "served": served, "ok": ok}

    out = await go()

    assert out["seen"] and out["dropped"], out["stats"]
    assert out["stats"].cancelled_sequences == 1 and out["stats"].decode_steps <= 5  # held at 4, dropped before 5
    assert out["served"] == 0  # dropped, not finished
    assert len(out["ok"].samples[0].token_ids) == 2  # the engine serves on


async def test_a_refused_stream_fails_before_its_first_chunk_with_generates_codes(tiny_model_dir: Path) -> None:
    async def go() -> dict[str, grpc.StatusCode]:
        codes = {}
        async with inference_server(tiny_model_dir) as (target, service), InferenceClient(target) as client:
            too_long = pb.SamplingParams(n=1, max_new_tokens=service.cfg.max_new_tokens_limit + 1)
            too_many = pb.SamplingParams(n=service.cfg.max_samples_per_request + 1, max_new_tokens=2)
            for name, sampling in (("invalid", too_long), ("limit", too_many)):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    async for _ in client.generate_stream("1+", sampling, timeout_s=30):
                        pass
                codes[name] = failed.value.code()
            async with grpc.aio.insecure_channel(service.weights_target) as channel:
                stub = pb_grpc.InferenceServiceStub(channel)
                request = pb.GenerateRequest(prompt_text="1+", sampling=pb.SamplingParams(n=1, max_new_tokens=2))
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    async for _ in stub.GenerateStream(request, timeout=30):
                        pass
                codes["weights port"] = failed.value.code()
        return codes

    codes = await go()

    assert codes == {
        "invalid": grpc.StatusCode.INVALID_ARGUMENT,
        "limit": grpc.StatusCode.RESOURCE_EXHAUSTED,
        "weights port": grpc.StatusCode.PERMISSION_DENIED,
    }
