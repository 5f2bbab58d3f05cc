"""The control plane shared by services: who may change state, and the config as an operator sees it.

Mutating control calls (pause/resume generation, request a checkpoint) require a bearer token when one is
configured: gRPC metadata ``authorization: Bearer <token>`` or the HTTP header of the same name. The token comes
from the environment variable named by ``control.token_env`` (preferred: it stays out of config files) or from
``control.token``. Read-only calls (status, config, health, metrics) need none. Config views redact secrets:
fields whose metadata marks them ``secret`` ("value": the whole value; "password": the password of a URL).
"""

from __future__ import annotations

import dataclasses
import hmac
import re
from typing import Any

import grpc
import yaml

from relayrl.common.config import REDACTED, to_dict


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``authorization`` value grants mutating access (always, when no token is configured)."""
    if not token:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header.removeprefix("Bearer ").strip().encode(), token.encode())


async def require_token(context: grpc.aio.ServicerContext, token: str) -> None:
    """Abort a gRPC call with UNAUTHENTICATED unless it carries the configured bearer token."""
    metadata = dict(context.invocation_metadata() or ())
    header = metadata.get("authorization")
    if not authorized(header if isinstance(header, str) else None, token):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this control call needs authorization: Bearer <token>")


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
