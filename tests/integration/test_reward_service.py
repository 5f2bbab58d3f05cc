"""The reward service over real gRPC and HTTP: scores, and failures as explicit errors (never 0)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import httpx
import pytest

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.pb import reward_pb2 as pb
from relayrl.common.pb import reward_pb2_grpc as pb_grpc
from relayrl.config.reward import ComponentConfig
from tests.integration.helpers import reward_http, reward_server

pytestmark = pytest.mark.integration

FNS = "tests.reward_fns"


def _req(completion: str, reference: str = "7", episode_id: str = "e") -> pb.ScoreRequest:
    return pb.ScoreRequest(episode_id=episode_id, prompt="3+4=", completion=completion, reference=reference)


async def test_score_batch_returns_scores_and_components_in_order() -> None:
    async def go() -> None:
        async with reward_server() as (target, _), insecure_channel(target) as ch:
            stub = pb_grpc.RewardServiceStub(ch)
            resp = await stub.ScoreBatch(
                pb.ScoreBatchRequest(
                    requests=[_req("7", episode_id="a"), _req("77", episode_id="b"), _req("3", episode_id="c")]
                ),
                timeout=10,
            )

            assert [r.episode_id for r in resp.responses] == ["a", "b", "c"]
            assert [r.status for r in resp.responses] == [pb.SCORE_STATUS_OK] * 3
            assert [r.score for r in resp.responses] == [1.0, 0.5, 0.0]
            assert resp.responses[0].components["exact"] == 1.0

    await go()


async def test_raising_verifier_is_an_error_result_counted_not_zero() -> None:
    async def go() -> None:
        async with reward_server(f"{FNS}:broken") as (target, servicer), insecure_channel(target) as ch:
            stub = pb_grpc.RewardServiceStub(ch)
            resp = await stub.Score(_req("7"), timeout=10)
            status = await stub.GetStatus(pb.GetRewardStatusRequest(), timeout=10)

            assert resp.status == pb.SCORE_STATUS_ERROR
            assert "ZeroDivisionError: verifier bug" in resp.error
            assert (status.errors, status.scored, status.timeouts) == (1, 0, 0)
            assert servicer.metrics.scores.labels("error")._value.get() == 1

    await go()


@pytest.mark.parametrize("function", ["returns_nan", "returns_text", "returns_none", "exits"])
async def test_invalid_return_value_or_exit_is_an_error_result(function: str) -> None:
    async def go() -> None:
        async with reward_server(f"{FNS}:{function}", workers=1) as (target, _), insecure_channel(target) as ch:
            resp = await pb_grpc.RewardServiceStub(ch).Score(_req("7"), timeout=10)

            assert resp.status == pb.SCORE_STATUS_ERROR
            assert resp.error

    await go()


async def test_hung_verifier_times_out_alone_and_its_worker_is_replaced() -> None:
    async def go() -> None:
        async with reward_server(f"{FNS}:spin", timeout_s=1.0) as (target, servicer), insecure_channel(target) as ch:
            stub = pb_grpc.RewardServiceStub(ch)
            resp = await stub.ScoreBatch(
                pb.ScoreBatchRequest(requests=[_req("ok"), _req("hang"), _req("ok"), _req("ok")]), timeout=20
            )
            for _ in range(100):  # the replacement starts in the background
                if servicer.pool.ready_workers == 2:
                    break
                await asyncio.sleep(0.05)
            after = await stub.Score(_req("ok"), timeout=10)
            status = await stub.GetStatus(pb.GetRewardStatusRequest(), timeout=10)

            assert [r.status for r in resp.responses] == [
                pb.SCORE_STATUS_OK,
                pb.SCORE_STATUS_TIMEOUT,
                pb.SCORE_STATUS_OK,
                pb.SCORE_STATUS_OK,
            ]
            assert "did not finish within 1s" in resp.responses[1].error
            # one kill (the hung request's worker), no other: the rest of the batch was scored, not killed
            assert servicer.pool.restarts == {"timeout": 1, "crash": 0}
            assert (status.timeouts, status.worker_restarts, status.workers_ready) == (1, 1, 2)
            assert after.status == pb.SCORE_STATUS_OK

    await go()


async def test_crashing_verifier_is_an_error_and_the_rest_of_the_batch_is_scored() -> None:
    async def go() -> None:
        async with reward_server(f"{FNS}:crash") as (target, servicer), insecure_channel(target) as ch:
            resp = await pb_grpc.RewardServiceStub(ch).ScoreBatch(
                pb.ScoreBatchRequest(requests=[_req("ok"), _req("crash"), _req("ok"), _req("ok")]), timeout=20
            )

            assert [r.status for r in resp.responses] == [
                pb.SCORE_STATUS_OK,
                pb.SCORE_STATUS_ERROR,
                pb.SCORE_STATUS_OK,
                pb.SCORE_STATUS_OK,
            ]
            assert "worker process died (exit code 3)" in resp.responses[1].error
            assert servicer.pool.restarts["crash"] == 1

    await go()


async def test_batch_is_scored_in_parallel_across_the_pool(tmp_path: Path) -> None:
    # each verifier records its start in tmp_path and waits (at most 5 s) until all four have started
    metadata = {"dir": json.dumps(str(tmp_path)), "expect": "4", "wait_s": "5"}

    async def go() -> None:
        async with reward_server(f"{FNS}:rendezvous", workers=4) as (target, _), insecure_channel(target) as ch:
            stub = pb_grpc.RewardServiceStub(ch)
            resp = await stub.ScoreBatch(
                pb.ScoreBatchRequest(
                    requests=[pb.ScoreRequest(episode_id=str(i), completion="x", metadata=metadata) for i in range(4)]
                ),
                timeout=20,
            )

            assert [r.status for r in resp.responses] == [pb.SCORE_STATUS_OK] * 4
            # every verifier saw four started while it ran: the four workers scored at once (serially: 1, 2, ...)
            assert [r.details for r in resp.responses] == ["4"] * 4

    await go()


async def test_async_reward_function_is_awaited() -> None:
    async def go() -> None:
        async with reward_server(f"{FNS}:async_half", workers=1) as (target, _), insecure_channel(target) as ch:
            resp = await pb_grpc.RewardServiceStub(ch).Score(_req("x"), timeout=10)

            assert (resp.status, resp.score, resp.details, dict(resp.components)) == (
                pb.SCORE_STATUS_OK,
                0.5,
                "x",
                {"half": 0.5},
            )

    await go()


async def test_weighted_components_form_the_total_and_are_reported_by_name() -> None:
    components = [
        ComponentConfig(name="answer", function="arithmetic", weight=0.75),
        ComponentConfig(name="length", function=f"{FNS}:length", weight=0.25, params={"scale": 0.5}),
    ]

    async def go() -> None:
        async with reward_server(components=components, workers=1) as (target, _), insecure_channel(target) as ch:
            resp = await pb_grpc.RewardServiceStub(ch).Score(_req("7"), timeout=10)

            assert resp.status == pb.SCORE_STATUS_OK
            assert resp.score == pytest.approx(0.75 * 1.0 + 0.25 * 0.5)
            assert dict(resp.components) == {"answer": 1.0, "answer.exact": 1.0, "answer.digits": 1.0, "length": 0.5}

    await go()


async def test_batch_over_max_batch_is_resource_exhausted() -> None:
    async def go() -> None:
        async with reward_server(max_batch=2, workers=1) as (target, _), insecure_channel(target) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.RewardServiceStub(ch).ScoreBatch(
                    pb.ScoreBatchRequest(requests=[_req("1")] * 3), timeout=10
                )

            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    await go()


async def test_rest_api_scores_reports_errors_health_and_metrics() -> None:
    async def go() -> None:
        async with (
            reward_server(f"{FNS}:crash", workers=1) as (_, servicer),
            reward_http(servicer) as url,
            httpx.AsyncClient(base_url=url, timeout=10) as client,
        ):
            ok = await client.post(
                "/score", json={"completion": "fine", "reference": "7", "metadata": {"tests": ["assert True"]}}
            )
            failed = await client.post("/score", json={"episode_id": "x", "completion": "crash"})
            invalid = await client.post("/score", json={"prompt": "no completion"})
            for _ in range(100):
                if servicer.pool.ready_workers == 1:
                    break
                await asyncio.sleep(0.05)
            health = await client.get("/healthz")
            metrics = (await client.get("/metrics")).text

            assert ok.status_code == 200 and ok.json()["status"] == "ok" and ok.json()["score"] == 1.0
            assert failed.status_code == 200
            assert failed.json()["status"] == "error" and failed.json()["score"] is None
            assert "worker process died" in failed.json()["error"]
            assert invalid.status_code == 422
            assert health.status_code == 200 and health.json()["workers_ready"] == 1
            assert 'relayrl_reward_scores_total{status="error"} 1.0' in metrics
            assert 'relayrl_reward_worker_restarts_total{reason="crash"} 1.0' in metrics

    await go()
