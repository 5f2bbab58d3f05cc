"""The control plane shared by services: who may change state, and the config as an operator sees it.

Mutating control calls (pause/resume generation, request a checkpoint) require a bearer token: gRPC metadata
``authorization: Bearer <token>`` or the HTTP header of the same name; with none configured they are refused.
The token comes from the environment variable named by ``control.token_env`` (preferred: it stays out of config
files) or from ``control.token``. Read-only calls (status, config, health, metrics) need none. Config views
redact secrets: fields whose metadata marks them ``secret`` ("value": the whole value; "password": the password
of a URL).
"""

from __future__ import annotations

import dataclasses
import hmac
import re
from typing import Any

import grpc
import yaml

from relayrl.config.typed import REDACTED, ConfigError, to_dict


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``authorization`` value carries ``token`` (never, when no token is configured: a call that
    needs a credential is refused rather than open)."""
    if not token or not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header.removeprefix("Bearer ").strip().encode(), token.encode())


async def require_token(context: grpc.aio.ServicerContext, token: str, what: str = "this control call") -> None:
    """Abort a gRPC call with UNAUTHENTICATED unless it carries ``token`` (PERMISSION_DENIED when the service has
    no token configured, so nobody can make the call)."""
    if not token:
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED, f"{what} is disabled: the service has no credential configured"
        )
    metadata = dict(context.invocation_metadata() or ())
    header = metadata.get("authorization")
    if not authorized(header if isinstance(header, str) else None, token):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{what} needs authorization: Bearer <token>")


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def require_credential(token: str, hosts: dict[str, str], credential: str) -> None:
    """Start-up check: a service that listens beyond loopback (any of ``hosts``: config field -> host) must have
    ``credential`` configured; raises ConfigError naming the field."""
    exposed = [f for f, host in hosts.items() if not is_loopback(host)]
    if exposed and not token:
        raise ConfigError(
            exposed[0],
            hosts[exposed[0]],
            f"listening beyond loopback needs {credential} (set it through its environment variable)",
        )


def redacted(cfg: Any) -> dict[str, Any]:
    """Plain-data view of a config tree with every secret field redacted."""
    data: dict[str, Any] = to_dict(cfg)
    _redact(cfg, data)
    return data


def _redact(obj: Any, data: dict[str, Any]) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _redact(value, data[f.name])
            continue
        kind = f.metadata.get("secret")
        if kind == "value" and value:
            data[f.name] = REDACTED
        elif kind == "password" and isinstance(value, str):
            data[f.name] = redact_url_password(value)


_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][\w+.-]*://[^:@/\s]*):[^@/\s]*@")


def redact_url_password(value: str) -> str:
    """``redis://user:secret@host`` → ``redis://user:***@host`` (anything else unchanged)."""
    return _URL_PASSWORD.sub(rf"\g<head>:{REDACTED}@", value)


def redacted_yaml(cfg: Any) -> str:
    return yaml.safe_dump(redacted(cfg), sort_keys=False)
