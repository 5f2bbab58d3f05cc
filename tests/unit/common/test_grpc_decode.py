"""Requests whose bytes do not decode are refused as the caller's error on every kind of method, and the
interceptor changes nothing for well-formed calls (unary, server streaming with context.write, client streaming)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relayrl.common.grpc_utils import create_server, insecure_channel
from relayrl.config.endpoints import ServerConfig

BAD = b"\xff\xff\xff"  # a truncated varint: no message parses from it


async def test_health_check_and_watch_work_through_the_interceptor_and_bad_bytes_are_invalid_argument() -> None:
    async def go() -> tuple[int, int, grpc.StatusCode, grpc.StatusCode]:
        handle = create_server(ServerConfig(port=0), [], [])
        await handle.start()
        try:
            async with insecure_channel(f"127.0.0.1:{handle.port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                check = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
                first = await watch.read()
                watch.cancel()
                codes = []
                for method in ("Check", "Watch"):
                    call = (
                        ch.unary_unary(f"/grpc.health.v1.Health/{method}")
                        if method == "Check"
                        else ch.unary_stream(f"/grpc.health.v1.Health/{method}")
                    )
                    try:
                        result = call(BAD, timeout=10)
                        if method == "Check":
                            await result
                        else:
                            await result.read()
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
        finally:
            await handle.stop(0)
        return check.status, first.status, codes[0], codes[1]

    check, watched, bad_check, bad_watch = await go()

    assert check == watched == health_pb2.HealthCheckResponse.SERVING
    assert bad_check == bad_watch == grpc.StatusCode.INVALID_ARGUMENT
