"""Where services listen and are reached: the gRPC ``server`` and REST ``http`` sections of every service."""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.common.config import ConfigError


@dataclass
class ServerConfig:
    """Where a service's gRPC server listens, and where clients reach it."""

    host: str = field(default="127.0.0.1", metadata={"help": "Address the gRPC server binds to."})
    port: int = field(default=0, metadata={"help": "gRPC port (0: any free port).", "ge": 0, "le": 65535})
    address: str = field(default="", metadata={
        "help": "host:port that clients use to reach the service; empty means host:port."})
    shutdown_grace_s: float = field(default=5.0, metadata={
        "help": "Grace period for in-flight calls at shutdown.", "ge": 0})

    def validate(self) -> None:
        if not self.host:
            raise ConfigError("host", self.host, "must not be empty")

    @property
    def target(self) -> str:
        """Where clients connect: ``address`` when set, else host:port (wildcard hosts -> loopback)."""
        if self.address:
            return self.address
        connect = "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]") else self.host
        return f"{connect}:{self.port}"


def server_config(port: int) -> ServerConfig:
    """Default factory for a service's ``server`` section with its conventional port."""
    return ServerConfig(port=port)


@dataclass
class HttpConfig:
    enabled: bool = field(default=True, metadata={"help": "Serve the HTTP API (REST, /healthz, /metrics)."})
    host: str = field(default="0.0.0.0", metadata={"help": "Interface the HTTP server binds."})
    port: int = field(default=8000, metadata={"help": "HTTP port (0: any free port).", "ge": 0, "le": 65535})


def http_config(port: int) -> HttpConfig:
    """Default factory for a service's ``http`` section with its conventional port."""
    return HttpConfig(port=port)
