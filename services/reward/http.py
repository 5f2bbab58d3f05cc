"""The reward service's REST API (FastAPI), served by relayrl.common.http.HttpServer on the gRPC server's loop.

- ``POST /score``: one request (``prompt``, ``completion``, ``reference``, ``metadata`` as plain JSON,
  optional ``episode_id``) -> ``status`` (``ok`` / ``error`` / ``timeout``), ``score``, ``components``,
  ``error``, ``details``. A failed verifier is a 200 with an error status (a result, not a transport error).
- ``GET /healthz``: 200 while every verifier worker is ready, else 503.
- ``GET /metrics``: Prometheus text format.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from relayrl.common.http import refuse_invalid_bodies
from relayrl.common.pb.common_pb2 import ServingState
from relayrl.reward.api import RewardInput
from relayrl.reward.protocol import Status
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
    status: Status  # ok | error | timeout
    score: float | None = None  # null unless status is ok
    components: dict[str, float] = Field(default_factory=dict)
    error: str = ""
    details: str = ""


def create_app(servicer: RewardServicer) -> FastAPI:
    app = FastAPI(title="relayrl reward", docs_url=None, redoc_url=None)
    refuse_invalid_bodies(app)

    @app.post("/score", response_model=ScoreResponseBody)
    async def score(body: ScoreRequestBody) -> ScoreResponseBody:
        inp = RewardInput(prompt=body.prompt, completion=body.completion, reference=body.reference,
                          metadata=body.metadata)
        (outcome,) = await servicer.score([inp], [body.episode_id])
        r = outcome.result
        return ScoreResponseBody(episode_id=body.episode_id, status=outcome.status,
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
