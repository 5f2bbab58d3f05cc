"""The REST face of a service's control plane (FastAPI), built from the same calls as its gRPC servicer.

GET /status (the status message as JSON), GET /config (secrets redacted), GET /healthz, GET /metrics
(Prometheus), and the service's mutating POST routes, which need ``Authorization: Bearer <token>`` (401
otherwise; 403 when the service has no control token, so nobody can call them). A browser cannot add that header
to a cross-origin form post, so a page on another origin cannot trigger them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import PlainTextResponse, Response
from google.protobuf.message import Message
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from relayrl.common.control import authorized
from relayrl.common.http import refuse_invalid_bodies
from relayrl.common.service import as_dict

Action = Callable[[], Awaitable[Message]]


def control_app(
    name: str,
    status: Callable[[], Message],
    config_yaml: Callable[[], str],
    token: str,
    registry: CollectorRegistry,
    actions: dict[str, Action],
) -> FastAPI:
    app = FastAPI(title=f"relayrl {name}", docs_url=None, redoc_url=None)
    refuse_invalid_bodies(app)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/status")
    async def get_status() -> dict[str, Any]:
        return as_dict(status())

    @app.get("/config")
    async def get_config() -> Response:
        return PlainTextResponse(config_yaml(), media_type="application/yaml")

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def route(action: Action) -> Callable[..., Awaitable[dict[str, Any]]]:
        async def handler(authorization: str | None = Header(default=None)) -> dict[str, Any]:
            if not token:
                raise HTTPException(
                    status_code=403, detail="control calls are disabled: no control token is configured"
                )
            if not authorized(authorization, token):
                raise HTTPException(
                    status_code=401,
                    detail="this control call needs Authorization: Bearer <token>",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            reply = await action()
            return as_dict(reply)

        return handler

    for path, action in actions.items():
        app.post(path)(route(action))
    return app
