"""Callers without a credential cannot consume the capacity that callers with one need (relayrl.common.grpc_admission).

grpc's own ``maximum_concurrent_rpcs`` counted every call before any credential: two health Watch streams, or two
calls that never send their request, filled the weights port (its cap was 2) and the trainer's weight push got
RESOURCE_EXHAUSTED; 32 WatchStatus streams made the trainer refuse GetStatus, which rollout's admission polls.
Now a call is admitted into its own budget: calls with a credential, unary calls without one, streams without one
(with a cap per peer host), each refused at once when full.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relayrl.client import InferenceClient, TrainerClient
from relayrl.common.grpc_admission import Budget, peer_host
from relayrl.common.grpc_utils import ServerHandle, create_server, insecure_channel
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.pb import trainer_pb2, trainer_pb2_grpc
from relayrl.common.weights import iter_update_messages, model_tensors
from relayrl.config.endpoints import ServerConfig
from relayrl.config.inference import InferenceConfig
from relayrl.inference.serving import InferenceService
from relayrl.trainer.server import create_trainer_server
from relayrl.trainer.status_watch import StatusPulse
from tests.conftest import WEIGHTS_TOKEN
from tests.integration.helpers import inference_server
from tests.polling import until

pytestmark = pytest.mark.security

AUTH = (("authorization", f"Bearer {WEIGHTS_TOKEN}"),)
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _update(service: InferenceService, version: int) -> list[pb.WeightUpdateMessage]:
    tensors = {k: v.detach() + 0.25 for k, v in model_tensors(service.engine.model).items()}  # type: ignore[attr-defined]
    return list(iter_update_messages(tensors, version, chunk_bytes=1 << 16))


def _weights_handle(service: InferenceService) -> ServerHandle:
    return service.grpc_handles[1]  # type: ignore[attr-defined,no-any-return]


async def _never() -> AsyncIterator[bytes]:
    await asyncio.Event().wait()  # a caller that opens the call and never sends its request
    yield b""


async def _fill(calls: list[Any], first: Callable[[Any], Awaitable[Any]]) -> tuple[list[Any], int]:
    """Wait until every call is either served (``first`` of it answers) or refused: (the served ones, refusals).
    A refusal with RESOURCE_EXHAUSTED means the calls before it filled what the server allows them."""
    outcomes = await asyncio.gather(*(first(c) for c in calls), return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert refused and all(o.code() is EXHAUSTED for o in refused)
    return [c for c, o in zip(calls, outcomes, strict=True) if not isinstance(o, BaseException)], len(refused)


async def test_unauthenticated_health_watch_streams_do_not_keep_the_trainers_weight_push_out(
    tiny_model_dir: Path,
) -> None:
    async def go() -> tuple[int, int, int, int]:
        async with (
            inference_server(tiny_model_dir) as (_, service),
            insecure_channel(service.weights_target) as channel,
        ):
            health = health_pb2_grpc.HealthStub(channel)
            watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(8)]
            held, refused = await _fill(watches, lambda w: w.read())  # each held one has its first status

            response = await pb_grpc.InferenceServiceStub(channel).UpdateWeights(
                iter(_update(service, 1)), timeout=30, metadata=AUTH
            )

            still_open = sum(not w.done() for w in held)
            for w in watches:
                w.cancel()
            return int(response.version), service.engine.version, refused, still_open

    pushed, served, refused, still_open = await go()

    assert pushed == served == 1
    assert refused > 0 and still_open > 0  # the port was full of streams while the push went through


async def test_calls_that_never_send_their_request_do_not_keep_the_trainers_weight_push_out(
    tiny_model_dir: Path,
) -> None:
    async def go() -> tuple[int, int, int, int]:
        async with (
            inference_server(tiny_model_dir) as (_, service),
            insecure_channel(service.weights_target) as channel,
        ):
            open_call = channel.stream_unary("/relayrl.v1.InferenceService/GetStatus")  # the request never comes
            calls = [open_call(_never(), timeout=60) for _ in range(20)]
            ends = [asyncio.ensure_future(c) for c in calls]
            done, _ = await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
            # one was refused at once: the calls before it fill what callers without a credential may hold
            assert all(isinstance(d.exception(), grpc.aio.AioRpcError) for d in done)
            assert all(d.exception().code() is EXHAUSTED for d in done)  # type: ignore[union-attr]

            response = await pb_grpc.InferenceServiceStub(channel).UpdateWeights(
                iter(_update(service, 1)), timeout=30, metadata=AUTH
            )

            still_open = sum(not c.done() for c in calls)
            holding = _weights_handle(service).admission.state.active[Budget.UNARY]  # their slots, not the push's
            for c in calls:
                c.cancel()
            await asyncio.gather(*ends, return_exceptions=True)
            return int(response.version), service.engine.version, still_open, holding

    pushed, served, still_open, holding = await go()

    assert pushed == served == 1
    assert still_open == holding == InferenceConfig().weights_server.max_unauthenticated_rpcs


def _fake_trainer(server: ServerConfig) -> Any:
    pulse = StatusPulse()

    async def refresh() -> None:
        return None

    cfg = SimpleNamespace(
        trainer=SimpleNamespace(server=server),
        tls=None,
        control=SimpleNamespace(effective_token=lambda: "control-token"),
    )
    return SimpleNamespace(
        cfg=cfg, progress=SimpleNamespace(changed=pulse), status=trainer_pb2.TrainerStatus, refresh_drops=refresh
    )


async def test_unauthenticated_watch_status_streams_do_not_starve_get_status_nor_rollouts_own_stream() -> None:
    async def go() -> tuple[int, int, int, int, int]:
        handle, _ = create_trainer_server(_fake_trainer(ServerConfig(port=0)))  # the trainer's default budgets
        await handle.start()
        try:
            async with insecure_channel(f"127.0.0.1:{handle.port}") as channel:
                stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                watches = [stub.WatchStatus(trainer_pb2.WatchTrainerStatusRequest(), timeout=60) for _ in range(40)]
                held, refused = await _fill(watches, lambda w: w.read())

                status = await stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10)
                # rollout's client (the control token on every call): its stream and polls have their own budget
                async with TrainerClient(
                    f"127.0.0.1:{handle.port}", token="control-token", authenticate_all=True
                ) as rollout:
                    stream = rollout.watch_status(30)
                    watched = await anext(stream)
                    await stream.aclose()
                    polled = await rollout.status()

                still_open = sum(not w.done() for w in held)
                for w in watches:
                    w.cancel()
                return status.step, watched.step, polled.step, refused, still_open
        finally:
            await handle.stop(0)

    step, watched, polled, refused, still_open = await go()

    assert step == watched == polled == 0  # answered
    assert refused > 0 and still_open > 0


async def _health_server(**limits: int) -> ServerHandle:
    handle = create_server(ServerConfig(host="[::]", port=0, **limits), [], [], section="probe.server")
    await handle.start()
    return handle


async def _watch(channel: grpc.aio.Channel) -> Any:
    """A health Watch stream, returned once the server serves it (its first status came)."""
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
    await call.read()
    return call


async def _refusal(channel: grpc.aio.Channel) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _watch(channel)
    return err.value.code(), err.value.details() or ""


async def test_streams_beyond_the_per_peer_cap_are_refused_at_once_while_another_peer_still_opens_its_own() -> None:
    async def go() -> tuple[tuple[grpc.StatusCode, str], tuple[grpc.StatusCode, str], dict[str, int]]:
        handle = await _health_server(max_streams=4, max_streams_per_peer=2)
        try:
            async with (
                insecure_channel(f"127.0.0.1:{handle.port}") as v4,
                insecure_channel(f"[::1]:{handle.port}") as v6,
            ):  # two peer hosts of the same machine
                mine = [await _watch(v4), await _watch(v4)]
                per_peer = await _refusal(v4)
                theirs = [await _watch(v6), await _watch(v6)]  # the other peer's share is still free
                global_cap = await _refusal(v6)
                hosts = dict(handle.admission.state.streams_by_peer)
                for call in mine + theirs:
                    call.cancel()
                return per_peer, global_cap, hosts
        finally:
            await handle.stop(0)

    per_peer, global_cap, hosts = await go()

    assert per_peer[0] is EXHAUSTED and "probe.server.max_streams_per_peer" in per_peer[1]
    assert global_cap[0] is EXHAUSTED and "probe.server.max_streams" in global_cap[1]
    assert sorted(hosts.values()) == [2, 2]


async def test_a_stream_slot_is_freed_when_its_call_is_cancelled() -> None:
    async def go() -> tuple[grpc.StatusCode, int, int]:
        handle = await _health_server(max_streams=1, max_streams_per_peer=1)
        try:
            async with insecure_channel(f"127.0.0.1:{handle.port}") as channel:
                first = await _watch(channel)
                code, _ = await _refusal(channel)
                first.cancel()
                state = handle.admission.state
                assert await until(lambda: state.active[Budget.STREAM] == 0)
                again = await _watch(channel)  # the freed slot serves the next stream
                held = state.active[Budget.STREAM]
                again.cancel()
                return code, held, state.refused["max_streams"]
        finally:
            await handle.stop(0)

    assert await go() == (EXHAUSTED, 1, 1)


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:127.0.0.1:5000", "127.0.0.1"),
        ("ipv6:[::1]:5000", "::1"),
        ("ipv6:%5B::1%5D:5000", "::1"),
        ("unix:/tmp/s", "unix:/tmp/s"),
    ],
)
def test_peer_host_drops_the_port(peer: str, host: str) -> None:
    assert peer_host(peer) == host


async def _held_open(release: asyncio.Event) -> AsyncIterator[pb.WeightUpdateMessage]:
    """An authorised update that holds its slot until ``release``, then ends without a manifest (refused)."""
    await release.wait()
    return
    yield


async def test_weight_push_refused_while_the_authenticated_budget_is_full_succeeds_by_retrying(
    tiny_model_dir: Path,
) -> None:
    async def go() -> tuple[int, int, int]:
        release = asyncio.Event()

        async with (
            inference_server(tiny_model_dir, weights_limits={"max_authenticated_rpcs": 1}) as (_, service),
            InferenceClient(service.weights_target, token=WEIGHTS_TOKEN, backoff_s=0.05) as client,
        ):
            state = _weights_handle(service).admission.state
            holder = pb_grpc.InferenceServiceStub(client.channel).UpdateWeights(
                _held_open(release), timeout=60, metadata=AUTH
            )
            assert await until(lambda: service.weight_streams == 1)
            retries: list[grpc.StatusCode] = []
            push = asyncio.ensure_future(client.update_weights(_update(service, 1), 1, 30, on_retry=retries.append))
            assert await until(lambda: state.refused[Budget.AUTHENTICATED.value] >= 1)  # the push met a full budget
            release.set()
            with pytest.raises(grpc.aio.AioRpcError):
                await holder  # ends without a manifest: refused
            response = await push
            assert response is not None
            return int(response.version), service.engine.version, len(retries)

    pushed, served, retries = await go()

    assert pushed == served == 1
    assert retries >= 1


async def test_weight_pushes_refused_at_admission_report_resource_exhausted_never_internal(
    tiny_model_dir: Path,
) -> None:
    """A push refused while its chunks are being written met grpc.aio's write race (grpc/grpc#36066): the failed
    write turned the server's RESOURCE_EXHAUSTED into INTERNAL, which is not retried. The client now writes only
    once the server has admitted the call, so every refusal arrives with its own code."""
    release = asyncio.Event()

    async with (
        inference_server(tiny_model_dir, weights_limits={"max_authenticated_rpcs": 1}) as (_, service),
        InferenceClient(service.weights_target, token=WEIGHTS_TOKEN, backoff_s=5.0) as client,  # no time to retry
    ):
        holder = pb_grpc.InferenceServiceStub(client.channel).UpdateWeights(
            _held_open(release), timeout=60, metadata=AUTH
        )
        assert await until(lambda: service.weight_streams == 1)
        messages = _update(service, 1)
        codes = []
        for _ in range(300):  # one try each: the old race turned a few of them into INTERNAL
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.update_weights(messages, 1, 2.0)
            codes.append(err.value.code())
        release.set()
        with pytest.raises(grpc.aio.AioRpcError):
            await holder

    assert set(codes) == {EXHAUSTED}, sorted({c.name for c in codes})


async def test_weight_push_meeting_a_full_budget_until_its_deadline_fails_with_resource_exhausted(
    tiny_model_dir: Path,
) -> None:
    async def go() -> tuple[grpc.StatusCode, str, int, int]:
        release = asyncio.Event()

        async with (
            inference_server(tiny_model_dir, weights_limits={"max_authenticated_rpcs": 1}) as (_, service),
            InferenceClient(service.weights_target, token=WEIGHTS_TOKEN, backoff_s=0.05) as client,
        ):
            holder = pb_grpc.InferenceServiceStub(client.channel).UpdateWeights(
                _held_open(release), timeout=60, metadata=AUTH
            )
            assert await until(lambda: service.weight_streams == 1)
            retries: list[grpc.StatusCode] = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.update_weights(_update(service, 1), 1, 1.0, on_retry=retries.append)
            release.set()
            with pytest.raises(grpc.aio.AioRpcError):
                await holder
            return err.value.code(), err.value.details() or "", len(retries), service.engine.version

    code, details, retries, served = await go()

    assert code is EXHAUSTED and "inference.weights_server.max_authenticated_rpcs" in details
    assert retries >= 1
    assert served == 0
