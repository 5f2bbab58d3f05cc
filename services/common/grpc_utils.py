"""gRPC plumbing shared by the services: server creation with health, graceful shutdown, channels."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from relayrl.common.grpc_decode import DecodeInHandler
from relayrl.config.endpoints import ServerConfig

log = logging.getLogger(__name__)

# Weight chunks stay under 4 MiB, but a big generation response or batch may not: allow 64 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


@dataclass
class ServerHandle:
    """A created (not yet started) server, its bound port and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    service_names: list[str]

    async def start(self) -> None:
        await self.server.start()
        for name in [*self.service_names, ""]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        """Graceful shutdown: report NOT_SERVING, then stop with a grace period for in-flight calls."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def create_server(
    cfg: ServerConfig,
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Sequence[str],
) -> ServerHandle:
    """Create an aio server with the given servicers and the standard health service, bound to host:port, with the
    section's limits on inbound message size and concurrent calls."""
    host, port = cfg.host, cfg.port
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", cfg.max_receive_mib * 1024 * 1024)]
    # beyond max_concurrent_rpcs grpc answers RESOURCE_EXHAUSTED at once instead of queueing without bound
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
                             interceptors=[DecodeInHandler()])  # undecodable bytes: INVALID_ARGUMENT
    for add in register:
        add(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    return ServerHandle(server=server, port=bound, health=health, service_names=list(service_names))


def stop_on_signals(stop: asyncio.Event | None = None) -> asyncio.Event:
    """The event that SIGTERM and SIGINT set (``stop`` when given, else a new one): how a service's ``serve``
    learns to shut down. Call it from the running event loop."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def run_until_signal(handle: ServerHandle, grace_s: float, stop: asyncio.Event | None = None) -> None:
    """Start ``handle`` and serve until SIGTERM/SIGINT (or ``stop`` is set), then shut down gracefully."""
    stop = stop_on_signals(stop)
    await handle.start()
    log.info("serving on port %d", handle.port)
    await stop.wait()
    log.info("shutting down (grace %.1fs)", grace_s)
    await handle.stop(grace_s)


def insecure_channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


def health_status(target: str, timeout_s: float, service: str = "") -> tuple[bool, str]:
    """One blocking grpc.health.v1 Check of ``target`` with a deadline: (SERVING?, status or error name)."""
    with grpc.insecure_channel(target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            return False, f"{code.name if code is not None else 'ERROR'}: {details}"
    return (resp.status == health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def check_health(target: str, timeout_s: float, service: str = "") -> bool:
    """True when ``target`` answers the standard health Check with SERVING within ``timeout_s``."""
    return health_status(target, timeout_s, service)[0]
