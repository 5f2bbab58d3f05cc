"""The reward service's REST API (FastAPI), served by uvicorn on the gRPC server's event loop.

- ``POST /score``: one request (``prompt``, ``completion``, ``reference``, ``metadata`` as plain JSON,
  optional ``episode_id``) -> ``status`` (``ok`` / ``error`` / ``timeout``), ``score``, ``components``,
  ``error``, ``details``. A failed verifier is a 200 with an error status (a result, not a transport error).
- ``GET /healthz``: 200 while every verifier worker is ready, else 503.
- ``GET /metrics``: Prometheus text format.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from relayrl.common.pb.common_pb2 import ServingState
from relayrl.reward.api import RewardInput
from relayrl.reward.config import HttpConfig
from relayrl.reward.server import RewardServicer

log = logging.getLogger(__name__)


class ScoreRequestBody(BaseModel):
    episode_id: str = ""
    prompt: str = ""
    completion: str
    reference: str = ""
    metadata: dict[str, Any] = Field(default_factory=dict)


class ScoreResponseBody(BaseModel):
    episode_id: str
    status: str  # ok | error | timeout
    score: float | None = None  # null unless status is ok
    components: dict[str, float] = Field(default_factory=dict)
    error: str = ""
    details: str = ""


def create_app(servicer: RewardServicer) -> FastAPI:
    app = FastAPI(title="relayrl reward", docs_url=None, redoc_url=None)

    @app.post("/score", response_model=ScoreResponseBody)
    async def score(body: ScoreRequestBody) -> ScoreResponseBody:
        inp = RewardInput(prompt=body.prompt, completion=body.completion, reference=body.reference,
                          metadata=body.metadata)
        (outcome,) = await servicer.score([inp], [body.episode_id])
        r = outcome.result
        return ScoreResponseBody(episode_id=body.episode_id, status=outcome.status.value,
                                 score=r.score if r is not None else None,
                                 components=dict(r.components) if r is not None else {}, error=outcome.error,
                                 details=r.details if r is not None else "")

    @app.get("/healthz")
    async def healthz(response: Response) -> dict[str, Any]:
        ready, size = servicer.pool.ready_workers, servicer.pool.size
        serving = servicer.header.state == ServingState.SERVING_STATE_SERVING and ready == size
        response.status_code = 200 if serving else 503
        return {"status": "serving" if serving else "not serving", "workers_ready": ready, "workers": size}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(servicer.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the service's own handlers stop it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """The REST API on ``cfg.host:cfg.port`` (port 0: a free one, see ``.port``), as a task of the running loop."""

    def __init__(self, cfg: HttpConfig, servicer: RewardServicer) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((cfg.host, cfg.port))
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(create_app(servicer), log_level="warning", lifespan="off", access_log=False)
        self.server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what made it fail
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        log.info("REST API on port %d", self.port)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.sock.close()
