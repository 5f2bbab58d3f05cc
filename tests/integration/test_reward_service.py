"""The reward service over real gRPC: scores, and failures as explicit errors (never 0)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.pb import reward_pb2 as pb
from relayrl.common.pb import reward_pb2_grpc as pb_grpc
from relayrl.reward.api import RewardInput, RewardResult
from relayrl.tasks.arithmetic import reward as arithmetic_reward
from tests.integration.helpers import reward_server

pytestmark = pytest.mark.integration


def _req(completion: str, reference: str = "7") -> pb.ScoreRequest:
    return pb.ScoreRequest(episode_id="e", prompt="3+4=", completion=completion, reference=reference)


def test_score_batch_returns_scores_and_components_in_order() -> None:
    async def go() -> None:
        async with reward_server(arithmetic_reward) as (target, _), insecure_channel(target) as ch:
            stub = pb_grpc.RewardServiceStub(ch)
            resp = await stub.ScoreBatch(pb.ScoreBatchRequest(requests=[_req("7"), _req("17"), _req("3")]),
                                         timeout=10)

            assert [r.status for r in resp.responses] == [pb.SCORE_STATUS_OK] * 3
            assert [r.score for r in resp.responses] == [1.0, 0.0, 0.0]
            assert resp.responses[0].components["exact"] == 1.0

    asyncio.run(go())


def test_raising_verifier_is_an_error_result_not_zero() -> None:
    def broken(inp: RewardInput) -> float:
        raise ZeroDivisionError("verifier bug")

    async def go() -> None:
        async with reward_server(broken) as (target, servicer), insecure_channel(target) as ch:
            resp = await pb_grpc.RewardServiceStub(ch).Score(_req("7"), timeout=10)

            assert resp.status == pb.SCORE_STATUS_ERROR
            assert "ZeroDivisionError: verifier bug" in resp.error
            assert servicer.errors == 1

    asyncio.run(go())


@pytest.mark.parametrize("value", [float("nan"), "1.0", None])
def test_invalid_return_value_is_an_error_result(value: object) -> None:
    async def go() -> None:
        async with reward_server(lambda inp: value) as (target, _), insecure_channel(target) as ch:  # type: ignore[arg-type,return-value]
            resp = await pb_grpc.RewardServiceStub(ch).Score(_req("7"), timeout=10)

            assert resp.status == pb.SCORE_STATUS_ERROR

    asyncio.run(go())


def test_slow_verifier_times_out_within_the_limit() -> None:
    def slow(inp: RewardInput) -> float:
        time.sleep(3)
        return 1.0

    async def go() -> None:
        async with reward_server(slow, timeout_s=0.3) as (target, _), insecure_channel(target) as ch:
            t0 = time.monotonic()
            resp = await pb_grpc.RewardServiceStub(ch).Score(_req("7"), timeout=10)

            assert resp.status == pb.SCORE_STATUS_TIMEOUT
            assert time.monotonic() - t0 < 1.3

    asyncio.run(go())


def test_async_reward_function_is_awaited() -> None:
    async def scorer(inp: RewardInput) -> RewardResult:
        await asyncio.sleep(0)
        return RewardResult(score=0.5, components={"half": 0.5}, details=inp.completion)

    async def go() -> None:
        async with reward_server(scorer) as (target, _), insecure_channel(target) as ch:
            resp = await pb_grpc.RewardServiceStub(ch).Score(_req("x"), timeout=10)

            assert (resp.status, resp.score, resp.details) == (pb.SCORE_STATUS_OK, 0.5, "x")

    asyncio.run(go())


def test_oversized_batch_is_invalid_argument() -> None:
    async def go() -> None:
        async with reward_server(arithmetic_reward, max_batch=2) as (target, _), insecure_channel(target) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.RewardServiceStub(ch).ScoreBatch(
                    pb.ScoreBatchRequest(requests=[_req("1")] * 3), timeout=10)

            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(go())
