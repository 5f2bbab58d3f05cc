"""gRPC plumbing shared by the services: server creation with health, graceful shutdown, channels.

Every server comes from :func:`create_server` (with health and server reflection, so ``grpcurl``-style tools can
list and call its services from their descriptors) and every channel from :func:`channel` (async) or
:func:`health_status` (blocking): with a ``tls`` section that is on, servers listen with TLS (mutual TLS with
``require_client_cert``) and channels verify servers against its CA; without it, plaintext.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from relayrl.common.grpc_admission import Admission, Token
from relayrl.common.grpc_decode import DecodeInHandler
from relayrl.common.lifecycle import start_up_done
from relayrl.config.endpoints import ServerConfig
from relayrl.config.tls import TlsConfig
from relayrl.config.typed import ConfigError

log = logging.getLogger(__name__)

# Weight chunks stay under 4 MiB, but a big generation response or batch may not: allow 64 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a server that restarted (an inference or reward replica) is dialled again within 5 s, not gRPC's 120 s
    ("grpc.max_reconnect_backoff_ms", 5000),
]


@dataclass
class ServerHandle:
    """A created (not yet started) server, its bound port and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    service_names: list[str]
    admission: Admission  # its ``state``: the calls each budget holds, the refusals so far

    async def start(self) -> None:
        start_up_done()  # what start-up built leaves the garbage collector's walks (a service process only)
        await self.server.start()
        for name in [*self.service_names, ""]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        """Graceful shutdown: report NOT_SERVING, then stop with a grace period for in-flight calls."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def connection_age_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """grpc's bounded connection age: after ``max_connection_age_s`` (grpc adds +-10 % jitter) the server asks the
    client to reconnect (GOAWAY), letting calls in flight finish within ``max_connection_age_grace_s``; a balancing
    client then re-resolves its target and reaches replicas added since. Nothing when the age is 0 (unbounded)."""
    if not cfg.max_connection_age_s:
        return []
    return [
        ("grpc.max_connection_age_ms", int(cfg.max_connection_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", int(cfg.max_connection_age_grace_s * 1000)),
    ]


def create_server(
    cfg: ServerConfig,
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Sequence[str],
    tls: TlsConfig | None = None,
    tokens: Mapping[str, Token] | None = None,
    section: str = "server",
) -> ServerHandle:
    """Create an aio server with the given servicers and the standard health service, bound to host:port, with the
    section's limits on inbound message size and concurrent calls; with ``tls`` on, TLS only (no plaintext port).
    ``tokens``: full method name (``/relayrl.v1.TrainerService/RequestCheckpoint``) -> the token it needs, or a
    function that reads it (empty: nobody may call it). Calls are admitted by relayrl.common.grpc_admission (the
    credential first, then separate budgets), whose refusals name ``section`` (the config path of ``cfg``). Raises
    ConfigError naming the ``tls`` field of a missing or unreadable file."""
    host, port = cfg.host, cfg.port
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", cfg.max_receive_mib * 1024 * 1024),
        *connection_age_options(cfg),
    ]
    credentials = server_credentials(tls) if tls is not None and tls.enabled else None  # files read now
    # admission first (credential, then its budget: RESOURCE_EXHAUSTED at once over it); grpc's own cap is only an
    # outer backstop well above the budgets (grpc counts a call before any interceptor, credential or not)
    admission = Admission(cfg, tokens, section)
    server = grpc.aio.server(
        options=options, maximum_concurrent_rpcs=cfg.hard_cap, interceptors=[admission, DecodeInHandler()]
    )  # undecodable bytes: INVALID_ARGUMENT
    for add in register:
        add(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if cfg.reflection:
        enable_reflection(server, service_names)
    bound = (
        server.add_secure_port(f"{host}:{port}", credentials)
        if credentials is not None
        else server.add_insecure_port(f"{host}:{port}")
    )
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    return ServerHandle(
        server=server, port=bound, health=health, service_names=list(service_names), admission=admission
    )


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Register gRPC server reflection for the given services, health and reflection itself. It exposes only the
    schema (the same protos the repository publishes), never data; calls still need their credentials."""
    from grpc_reflection.v1alpha import reflection

    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)


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


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """A server's TLS credentials: its certificate and key; with ``require_client_cert`` the CA that client
    certificates must chain to, and the demand for one (mutual TLS)."""
    files = tls.read()
    if files.cert is None or files.key is None:
        raise ConfigError(
            "tls.cert_file",
            tls.cert_file,
            "a TLS server needs a certificate and its key (TLS is on "
            "because tls.ca_file or tls.client_cert_file is set)",
        )
    return grpc.ssl_server_credentials(
        [(files.key, files.cert)],
        root_certificates=files.ca if tls.require_client_cert else None,
        require_client_auth=tls.require_client_cert,
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """A client's TLS credentials: the CA that server certificates must chain to (None: the system's roots) and the
    certificate it presents (``client_cert_file``, else ``cert_file``; none when neither is set)."""
    files = tls.read()
    cert, key = (files.client_cert, files.client_key) if files.client_cert is not None else (files.cert, files.key)
    return grpc.ssl_channel_credentials(root_certificates=files.ca, private_key=key, certificate_chain=cert)


def _tls_options(tls: TlsConfig) -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []


# Spread calls over every address the target resolves to (a headless Service's pods, an ``ipv4:a:p,b:p`` list),
# picking only connected ones; grpc re-resolves the name when a connection closes (a server's bounded connection
# age, a pod gone), so added replicas are found too.
BALANCED_OPTIONS = [("grpc.lb_policy_name", "round_robin")]


def channel(target: str, tls: TlsConfig | None = None, balanced: bool = False) -> grpc.aio.Channel:
    """The async channel to ``target``: TLS when ``tls`` is on (reading its files now), else plaintext; with
    ``balanced``, calls go round robin over every address ``target`` resolves to (else to the first that connects)."""
    options = [*CHANNEL_OPTIONS, *(BALANCED_OPTIONS if balanced else [])]
    if tls is None or not tls.enabled:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, channel_credentials(tls), options=[*options, *_tls_options(tls)])


def insecure_channel(target: str) -> grpc.aio.Channel:
    """A plaintext async channel (tests and tools that mean plaintext; services use :func:`channel`)."""
    return channel(target, None)


def _blocking_channel(target: str, tls: TlsConfig | None) -> grpc.Channel:
    if tls is None or not tls.enabled:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, channel_credentials(tls), options=_tls_options(tls))


def health_status(target: str, timeout_s: float, service: str = "", tls: TlsConfig | None = None) -> tuple[bool, str]:
    """One blocking grpc.health.v1 Check of ``target`` with a deadline (over TLS when ``tls`` is on): (SERVING?,
    status or error name)."""
    with _blocking_channel(target, tls) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            return False, f"{code.name if code is not None else 'ERROR'}: {details}"
    return (
        resp.status == health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status),
    )


def check_health(target: str, timeout_s: float, service: str = "", tls: TlsConfig | None = None) -> bool:
    """True when ``target`` answers the standard health Check with SERVING within ``timeout_s``."""
    return health_status(target, timeout_s, service, tls)[0]
