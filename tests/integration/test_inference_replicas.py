"""Several inference replicas behind one rollout (inference.endpoints): generation spread over them by least work
in flight, every weight version pushed to each and verified, a replica that fails taken out of routing with its
calls generated again elsewhere (counted), and the run's books adding up throughout."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import grpc
import pytest

from relayrl.client import InferenceClient
from relayrl.client.inference_pool import InferencePool, pinned
from relayrl.common.pb import inference_pb2
from relayrl.common.pb.common_pb2 import ServingState
from relayrl.config.publication import WeightTransport
from relayrl.inference.serving import WeightSwapError
from tests.conftest import RedisServer
from tests.integration.helpers import inference_server
from tests.integration.stack import run_stack, stack_config
from tests.polling import until

pytestmark = pytest.mark.integration


def _books_add_up(out: dict[str, Any], groups: int) -> None:
    assert out["trained"] == groups
    assert out["produced"] == out["trained"] + out["dropped"] + out["invalid"] + out["pending"]
    assert out["dropped_reward_error"] == out["episodes_reward_errors"] == out["invalid"] == 0


async def test_three_replicas_share_generation_and_each_serves_every_verified_version(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    steps = 6
    cfg = stack_config(tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url, f"trainer.total_steps={steps}")

    out = await run_stack(cfg, tiny_model_dir, inference_replicas=3)

    _books_add_up(out, steps * 2)
    served = [service.requests_served for service in out["inference_services"]]
    assert all(n > 0 for n in served), served  # least work in flight: every replica took requests
    # the last publication reached each replica and was verified there: they all serve the trainer's last version
    assert (
        len(set(out["inference_versions"])) == 1 and out["inference_versions"][0] == out["rows"][-1]["weight_version"]
    )
    states = out["replica_counts"].pop("inference_replica_states")
    assert out["replica_counts"] == {
        "generations_regenerated": 0,
        "inference_replicas_routable": 3,
        "inference_replicas": 3,
    }
    assert len(states) == 3 and all(s.routable and not s.behind and s.samples_in_flight == 0 for s in states)
    assert all(r["staleness_max"] <= cfg.rollout.max_staleness for r in out["rows"])


async def test_a_replica_that_dies_with_requests_in_flight_leaves_routing_and_they_are_generated_again(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    steps = 8
    cfg = stack_config(tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url, f"trainer.total_steps={steps}")
    killed_at: list[int] = []

    async def kill_the_last_with_work_in_flight(services: list[Any]) -> None:
        doomed, stuck = services[-1], asyncio.Event()

        async def never_answers(*_: object) -> None:  # its generation calls stay in flight
            stuck.set()
            await asyncio.Event().wait()

        doomed.result = never_answers
        await stuck.wait()
        killed_at.append(doomed.engine.version)
        for handle in doomed.grpc_handles:  # as a kill: every call on it fails UNAVAILABLE
            await handle.stop(0)

    out = await run_stack(cfg, tiny_model_dir, inference_replicas=3, during=kill_the_last_with_work_in_flight)

    assert killed_at  # the replica died during the run
    _books_add_up(out, steps * 2)
    counts = out["replica_counts"]
    # its calls in flight were generated again on the others; it stays out of routing (nothing brings it back)
    assert counts["generations_regenerated"] >= 1 and counts["inference_replicas_routable"] == 2
    # the survivors got every version after the death; the dead one kept the one it had
    survivors = out["inference_versions"][:2]
    assert survivors == [out["rows"][-1]["weight_version"]] * 2 and out["inference_versions"][2] < survivors[0]


@pytest.mark.parametrize("failing", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
async def test_the_pool_fails_over_on_unavailable_and_deadline_and_readmits_a_replica_serving_the_floor(
    tiny_model_dir: Path, failing: grpc.StatusCode
) -> None:
    async with inference_server(tiny_model_dir) as (a, sa), inference_server(tiny_model_dir) as (b, sb):
        for service in (sa, sb):  # as relayrl.inference.main marks it once the engine is loaded
            service.header.state = ServingState.SERVING_STATE_SERVING
        pool = InferencePool([a, b], check_every_s=3600)  # the test runs each check itself
        try:
            sampling = inference_pb2.SamplingParams(n=2, max_new_tokens=2, temperature=1.0)
            calls: list[str] = []

            async def fail_once(client: InferenceClient) -> Any:
                calls.append(client.target)
                if len(calls) == 1:
                    raise grpc.aio.AioRpcError(failing, grpc.aio.Metadata(), grpc.aio.Metadata(), "injected")
                return await client.generate("1+1=", sampling, 30.0)

            answer = await pool._route(fail_once, 2, 30.0)
            assert len(answer.samples) == 2 and len(calls) == 2 and calls[0] != calls[1]
            assert pool.regenerated == 1 and sum(not r.routable for r in pool.replicas) == 1
            # the failed replica still serves (the failure was injected): the check brings it back, but only while
            # it serves a version no older than the routable replica's
            out = next(r for r in pool.replicas if not r.routable)
            back = next(s for t, s in ((a, sa), (b, sb)) if t == out.address)
            back.header.state = ServingState.SERVING_STATE_STARTING
            await pool.check()
            assert not out.routable  # not SERVING: stays out
            back.header.state = ServingState.SERVING_STATE_SERVING
            await pool.check()
            assert all(r.routable for r in pool.replicas)
        finally:
            await pool.close()


async def test_the_check_takes_out_a_routable_replica_that_restarted_or_is_gone_and_waits_for_the_floor(
    tiny_model_dir: Path,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        a, sa = await stack.enter_async_context(inference_server(tiny_model_dir))
        b_server = inference_server(tiny_model_dir)
        b, sb = await b_server.__aenter__()
        for service in (sa, sb):  # as relayrl.inference.main marks it once the engine is loaded
            service.header.state = ServingState.SERVING_STATE_SERVING
        pool = await stack.enter_async_context(InferencePool([a, b], check_every_s=3600))  # checks run by the test
        try:
            await pool.check()
            ra, rb = pool.replicas
            assert ra.routable and rb.routable and ra.version == rb.version == 0
            # both served version 3; a still does, b serves 0 now: it restarted with its start-up weights
            sa.engine._version = ra.version = rb.version = 3  # type: ignore[attr-defined]
            await pool.check()
            assert ra.routable and not rb.routable
            await pool.check()
            assert not rb.routable  # older than the oldest routable replica's version: stays out
            sb.engine._version = 3  # type: ignore[attr-defined]  # the trainer's watchdog caught it up
            await pool.check()
            assert rb.routable
        finally:
            await b_server.__aexit__(None, None, None)
        # b is gone (its server stopped): the check takes it out before any call waits on it
        await pool.check()
        assert ra.routable and not rb.routable
        assert pool._pick(set()) is ra


async def test_a_pinned_session_stays_on_its_replica_while_it_serves_then_moves_once_and_stays(
    tiny_model_dir: Path,
) -> None:
    async with inference_server(tiny_model_dir) as (a, sa), inference_server(tiny_model_dir) as (b, sb):
        for service in (sa, sb):
            service.header.state = ServingState.SERVING_STATE_SERVING
        async with InferencePool([a, b], check_every_s=3600) as pool:
            sampling = inference_pb2.SamplingParams(n=1, max_new_tokens=2, temperature=1.0)
            session = pinned(pool)
            await session.generate("1+1=", sampling, 30.0)
            mine = session.pin.replica
            assert mine is not None
            mine.in_flight += 100  # least work in flight alone would now send every call to the other replica
            for _ in range(3):
                await session.generate("1+1=", sampling, 30.0)
            served = {a: sa.requests_served, b: sb.requests_served}
            assert served[mine.address] == 4 and sum(served.values()) == 4
            assert pool.sessions_moved == 0
            pool._evict(mine, "test")  # its replica leaves routing: the session moves, once, and stays
            for _ in range(2):
                await session.generate("1+1=", sampling, 30.0)
            mine.routable = True
            mine.in_flight -= 100
            await session.generate("1+1=", sampling, 30.0)
            assert session.pin.replica is not mine and pool.sessions_moved == 1
            assert {a: sa.requests_served, b: sb.requests_served}[session.pin.replica.address] == 3


async def test_a_replica_that_refuses_a_push_is_behind_and_rollout_routes_nothing_more_to_it(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    steps = 10
    cfg = stack_config(tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url, f"trainer.total_steps={steps}")
    seen: dict[str, int] = {}

    async def refuse_from_the_third_version(services: list[Any]) -> None:
        refuser, other = services[-1], services[0]
        apply = refuser.apply_update

        async def refusing(tensors: Any, version: int, probe: Any) -> list[float]:
            if version >= 3:  # as an engine whose swap failed: the old weights serve on
                seen.setdefault("refused_at", version)
                raise WeightSwapError(f"injected: version {version} refused")
            return await apply(tensors, version, probe)

        refuser.apply_update = refusing
        # two publications after the first refusal, rollout has long seen the trainer call it behind
        assert await until(lambda: "refused_at" in seen and other.engine.version >= seen["refused_at"] + 2, 120.0)
        seen["served_then"] = refuser.requests_served

    out = await run_stack(cfg, tiny_model_dir, inference_replicas=2, during=refuse_from_the_third_version)

    _books_add_up(out, steps * 2)
    refuser_version = out["inference_versions"][1]
    assert refuser_version < seen["refused_at"] and out["inference_versions"][0] == out["rows"][-1]["weight_version"]
    states = out["replica_counts"]["inference_replica_states"]
    assert states[1].behind and not states[0].behind
    assert out["inference_services"][1].requests_served == seen["served_then"]  # nothing routed to it since
    assert all(r["staleness_max"] <= cfg.rollout.max_staleness for r in out["rows"])  # its old tokens: none trained


async def test_replicas_on_different_weight_transports_each_get_every_version_prepared_once_per_transport(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    """One replica reads each version from the trainer's host (shared_memory), two receive it by one broadcast
    (collective): every replica serves the last version, verified, and no shared file stays behind."""
    steps = 5
    cfg = stack_config(tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url, f"trainer.total_steps={steps}")
    kinds = [WeightTransport.SHARED_MEMORY, WeightTransport.COLLECTIVE, WeightTransport.COLLECTIVE]

    out = await run_stack(cfg, tiny_model_dir, inference_replicas=3, replica_transports=kinds)

    _books_add_up(out, steps * 2)
    assert out["inference_versions"] == [out["rows"][-1]["weight_version"]] * 3
    assert all(service.weight_updates >= steps for service in out["inference_services"])
    assert not list(cfg.weights_dir.glob("*.shm.safetensors"))  # each served version's file went
