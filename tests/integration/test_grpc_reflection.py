"""gRPC server reflection: a client that has none of relayrl's protos (a fresh descriptor pool fed only by the
server, as grpcurl or Postman work) lists the services and calls one from the descriptors alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.integration.helpers import inference_server, reward_server

pytestmark = pytest.mark.integration


def _call_by_reflection(target: str, service: str, method: str, request: dict[str, Any]) -> tuple[list[str], dict]:
    """(services the server lists, the method's response as JSON) using only what reflection tells."""
    with grpc.insecure_channel(target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = list(db.get_services())
        pool = descriptor_pool.DescriptorPool(db)  # empty but for what the server describes
        m = pool.FindServiceByName(service).FindMethodByName(method)
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        call = channel.unary_unary(
            f"/{service}/{method}",
            request_serializer=req_cls.SerializeToString,
            response_deserializer=resp_cls.FromString,
        )
        response = call(json_format.ParseDict(request, req_cls()), timeout=30)
        return services, json_format.MessageToDict(response)


async def test_inference_lists_its_services_and_generates_from_reflected_descriptors(tiny_model_dir: Path) -> None:
    async def go() -> tuple[list[str], dict, list[str]]:
        async with inference_server(tiny_model_dir) as (target, service):
            listed, response = await asyncio.to_thread(
                _call_by_reflection,
                target,
                "relayrl.v1.InferenceService",
                "Generate",
                {"promptText": "1+2=", "sampling": {"n": 2, "temperature": 1.0, "maxNewTokens": 3}},
            )
            weights, _ = await asyncio.to_thread(
                _call_by_reflection, service.weights_target, "relayrl.v1.InferenceService", "GetStatus", {}
            )
            return listed, response, weights

    listed, response, weights_listed = await go()
    expected = {"relayrl.v1.InferenceService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert set(listed) == expected and set(weights_listed) == expected
    assert len(response["samples"]) == 2
    assert all(1 <= len(s["tokenIds"]) <= 3 for s in response["samples"])


async def test_reward_service_is_reflected_too() -> None:
    async def go() -> list[str]:
        async with reward_server(workers=1) as (target, _):
            listed, _ = await asyncio.to_thread(_call_by_reflection, target, "grpc.health.v1.Health", "Check", {})
            return listed

    assert "relayrl.v1.RewardService" in await go()


async def test_reflection_off_leaves_only_health() -> None:
    from relayrl.common.grpc_utils import create_server
    from relayrl.config.endpoints import ServerConfig

    def listing(target: str) -> grpc.StatusCode | None:
        with grpc.insecure_channel(target) as channel:
            try:
                ProtoReflectionDescriptorDatabase(channel).get_services()
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]
        return None

    async def go() -> grpc.StatusCode | None:
        handle = create_server(ServerConfig(port=0, reflection=False), [], [])
        await handle.start()
        try:
            return await asyncio.to_thread(listing, f"127.0.0.1:{handle.port}")
        finally:
            await handle.stop(0)

    assert await go() == grpc.StatusCode.UNIMPLEMENTED


async def test_reflected_descriptors_do_not_bypass_the_weights_token(tiny_model_dir: Path) -> None:
    """Reflection tells how to call UpdateWeights, not the right to: without the token the call is refused before
    any weight is read, and the served version does not move."""

    def push_without_token(target: str) -> grpc.StatusCode:
        with grpc.insecure_channel(target) as channel:
            pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
            m = pool.FindServiceByName("relayrl.v1.InferenceService").FindMethodByName("UpdateWeights")
            req_cls = message_factory.GetMessageClass(m.input_type)
            resp_cls = message_factory.GetMessageClass(m.output_type)
            call = channel.stream_unary(
                "/relayrl.v1.InferenceService/UpdateWeights",
                request_serializer=req_cls.SerializeToString,
                response_deserializer=resp_cls.FromString,
            )
            try:
                call(iter([json_format.ParseDict({"manifest": {"version": 7}}, req_cls())]), timeout=30)
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]
        raise AssertionError("UpdateWeights without the token was accepted")

    async def go() -> tuple[grpc.StatusCode, int]:
        async with inference_server(tiny_model_dir) as (_, service):
            code = await asyncio.to_thread(push_without_token, service.weights_target)
            return code, service.engine.version

    code, version = await go()
    assert code is grpc.StatusCode.UNAUTHENTICATED and version == 0
