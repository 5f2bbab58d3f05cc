"""Where services listen and are reached: the gRPC ``server`` and REST ``http`` sections of every service."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from relayrl.config.typed import ConfigError


@dataclass
class ServerConfig:
    """Where a service's gRPC server listens, and where clients reach it."""

    host: str = field(default="127.0.0.1", metadata={"help": "Address the gRPC server binds to."})
    port: int = field(default=0, metadata={"help": "gRPC port (0: any free port).", "ge": 0, "le": 65535})
    address: str = field(
        default="", metadata={"help": "host:port that clients use to reach the service; empty means host:port."}
    )
    shutdown_grace_s: float = field(
        default=5.0, metadata={"help": "Grace period for in-flight calls at shutdown.", "ge": 0}
    )
    max_receive_mib: int = field(
        default=1,
        metadata={
            "help": "Largest inbound gRPC message (MiB); a larger one is refused with RESOURCE_EXHAUSTED before it "
            "is buffered. Sized per service to what its callers send.",
            "ge": 1,
            "le": 1024,
        },
    )
    max_authenticated_rpcs: int = field(
        default=8,
        metadata={
            "help": "Calls carrying a valid credential of this service (weight pushes, pause, checkpoint, RunCode; any "
            "call with a valid bearer token) served at once: their own budget, which callers without a "
            "credential never take. One more is refused at once with RESOURCE_EXHAUSTED.",
            "ge": 1,
        },
    )
    max_unauthenticated_rpcs: int = field(
        default=32,
        metadata={
            "help": "Unary calls without a credential (status, config, Generate, Score, health Check) served at once, "
            "counted from the moment the call opens (a call that never sends its request holds its slot until "
            "its deadline); one more is refused at once with RESOURCE_EXHAUSTED.",
            "ge": 1,
        },
    )
    max_streams: int = field(
        default=32,
        metadata={
            "help": "Streaming calls without a credential (health Watch, WatchStatus, reflection, GenerateStream) open "
            "at once, all peers together; one more is refused at once with RESOURCE_EXHAUSTED.",
            "ge": 1,
        },
    )
    max_streams_per_peer: int = field(
        default=16,
        metadata={
            "help": "Streaming calls without a credential open at once from one peer host (of max_streams). Local "
            "callers all share the loopback host, so on loopback this bounds them together.",
            "ge": 1,
        },
    )
    max_concurrent_rpcs: int = field(
        default=32,
        metadata={
            "help": "Ignored: the budgets above replace it (grpc counted every call, health and reflection included, "
            "before any credential, so callers without one could fill it). The server's outer hard cap is "
            "derived from the budgets (twice their sum plus 64).",
            "ge": 1,
            "deprecated": "use max_authenticated_rpcs, max_unauthenticated_rpcs, max_streams and max_streams_per_peer",
            "removed_in": "0.4",
        },
    )
    max_connection_age_s: float = field(
        default=0.0,
        metadata={
            "help": "Seconds after which the server asks a client to reconnect (0: never). A client that balances "
            "over replicas (the reward client) then resolves the service's name again, so replicas added since "
            "(a scaled-up Deployment behind a headless Service) receive work.",
            "ge": 0,
        },
    )
    max_connection_age_grace_s: float = field(
        default=120.0,
        metadata={
            "help": "How long calls in flight on a connection past max_connection_age_s may still run before it "
            "closes; set it above the service's longest call.",
            "ge": 0,
        },
    )
    reflection: bool = field(
        default=True,
        metadata={
            "help": "Register gRPC server reflection, so grpcurl-style tools list and call the services without the "
            "protos. It describes the (public) schema only; calls still need their credentials."
        },
    )

    def validate(self) -> None:
        if not self.host:
            raise ConfigError("host", self.host, "must not be empty")
        if self.max_streams_per_peer > self.max_streams:
            raise ConfigError(
                "max_streams_per_peer", self.max_streams_per_peer, f"must be <= max_streams ({self.max_streams})"
            )

    @property
    def hard_cap(self) -> int:
        """grpc's own ``maximum_concurrent_rpcs``: an outer backstop that is never the binding limit. grpc counts a
        call before any interceptor sees it, so the cap sits well above the budgets' sum (a refused call holds it
        for the moment its refusal takes)."""
        return 2 * (self.max_authenticated_rpcs + self.max_unauthenticated_rpcs + self.max_streams) + 64

    @property
    def target(self) -> str:
        """Where clients connect: ``address`` when set, else host:port (wildcard hosts -> loopback)."""
        if self.address:
            return self.address
        connect = "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]") else self.host
        return f"{connect}:{self.port}"


def server_config(
    port: int,
    max_receive_mib: int = 1,
    max_authenticated_rpcs: int = 8,
    max_unauthenticated_rpcs: int = 32,
    max_streams: int = 32,
    max_streams_per_peer: int = 16,
    max_connection_age_s: float = 0.0,
) -> ServerConfig:
    """Default factory for a service's ``server`` section: its conventional port and the limits its callers need
    (the defaults fit control-plane servers: status, pause, checkpoint)."""
    return ServerConfig(
        port=port,
        max_receive_mib=max_receive_mib,
        max_authenticated_rpcs=max_authenticated_rpcs,
        max_unauthenticated_rpcs=max_unauthenticated_rpcs,
        max_streams=max_streams,
        max_streams_per_peer=max_streams_per_peer,
        max_connection_age_s=max_connection_age_s,
    )


@dataclass
class HttpConfig:
    enabled: bool = field(default=True, metadata={"help": "Serve the HTTP API (REST, /healthz, /metrics)."})
    host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "Interface the HTTP server binds (loopback by default; beyond loopback, a service with mutating "
            "calls needs its credential)."
        },
    )
    port: int = field(default=8000, metadata={"help": "HTTP port (0: any free port).", "ge": 0, "le": 65535})
    max_body_mib: int = field(
        default=1,
        metadata={"help": "Largest request body (MiB); a larger one gets 413 before it is read.", "ge": 1, "le": 1024},
    )
    allowed_hosts: list[str] = field(
        default_factory=lambda: ["localhost"],
        metadata={
            "help": "Host header names the HTTP API answers (any port), besides IP addresses and the bind host: a "
            "request naming another host gets 400 before any route runs, so a web page cannot read the API "
            "through DNS rebinding. '*.example.org' matches its subdomains; '*' answers any name "
            "(unsafe: DNS rebinding)."
        },
    )

    def validate(self) -> None:
        for name in self.allowed_hosts:
            if not HOST_PATTERN.fullmatch(name):
                raise ConfigError(
                    "allowed_hosts",
                    name,
                    "must be a host name without port or scheme (e.g. inference, *.svc.cluster.local), or '*'",
                )


HOST_PATTERN = re.compile(r"\*|(\*\.)?[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")


def http_config(port: int, max_body_mib: int = 1) -> HttpConfig:
    """Default factory for a service's ``http`` section with its conventional port and body limit."""
    return HttpConfig(port=port, max_body_mib=max_body_mib)
