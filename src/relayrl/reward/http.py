"""The reward service's REST API (FastAPI), served by relayrl.common.http.HttpServer on the gRPC server's loop.

- ``POST /score``: one request (``prompt``, ``completion``, ``reference``, ``metadata`` as plain JSON,
  optional ``episode_id``) -> ``status`` (``ok`` / ``error`` / ``timeout``), ``score``, ``components``,
  ``error``, ``details``. A failed verifier is a 200 with an error status (a result, not a transport error).
  When the reward runs code (``RewardServicer.runs_code``) it needs the code token as ``/run_code`` does (401
  without it, 403 when the service has none), checked before the body is scored.
- ``POST /run_code`` (RunCode's REST form, for tools written outside rollout): ``code``, ``stdin`` (text),
  ``timeout_s``, ``memory_mb`` (0: the defaults) -> ``status`` (``exited`` / ``timeout`` / ``output_exceeded`` /
  ``error``), ``exit_code``, ``stdout``, ``stderr`` (UTF-8, undecodable bytes replaced), ``wall_s``, ``error``.
  Needs ``Authorization: Bearer <code token>`` (401 without it, 403 when the service has none); a request over a
  limit is 413 and a malformed value 400, before anything runs.
- ``GET /healthz``: 200 while every verifier worker is ready, else 503.
- ``GET /metrics``: Prometheus text format.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from fastapi import FastAPI, Header, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from relayrl.common.control import authorized
from relayrl.common.http import refuse_invalid_bodies
from relayrl.common.pb import reward_pb2 as pb
from relayrl.common.pb.common_pb2 import ServingState
from relayrl.reward.api import RewardInput
from relayrl.reward.code_runs import RefusedRun, status_label
from relayrl.reward.protocol import Status
from relayrl.reward.server import SCORE_CALL, RewardServicer

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


class RunCodeBody(BaseModel):
    code: str
    stdin: str = ""
    timeout_s: float = 0.0  # 0: reward.code_runs.wall_timeout_s
    memory_mb: int = Field(default=0, ge=0)  # 0: reward.sandbox.memory_mb


class RunCodeResult(BaseModel):
    status: str  # exited | timeout | output_exceeded | error
    exit_code: int = 0
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    error: str = ""


REFUSED_HTTP = {grpc.StatusCode.RESOURCE_EXHAUSTED: 413, grpc.StatusCode.INVALID_ARGUMENT: 400}


def check_code_token(authorization: str | None, token: str, what: str = "run_code") -> None:
    """The code token over REST, as over gRPC: 403 when the service has none, 401 without it."""
    if not token:
        raise HTTPException(status_code=403, detail=f"{what} is disabled: the service has no code token configured")
    if not authorized(authorization, token):
        raise HTTPException(
            status_code=401,
            detail=f"{what} needs Authorization: Bearer <code token>",
            headers={"WWW-Authenticate": "Bearer"},
        )


def create_app(servicer: RewardServicer) -> FastAPI:
    app = FastAPI(title="relayrl reward", docs_url=None, redoc_url=None)
    refuse_invalid_bodies(app)

    @app.post("/score", response_model=ScoreResponseBody)
    async def score(body: ScoreRequestBody, authorization: str | None = Header(default=None)) -> ScoreResponseBody:
        if servicer.runs_code:  # before anything runs
            check_code_token(authorization, servicer.code_token, SCORE_CALL)
        inp = RewardInput(
            prompt=body.prompt, completion=body.completion, reference=body.reference, metadata=body.metadata
        )
        (outcome,) = await servicer.score([inp], [body.episode_id])
        r = outcome.result
        return ScoreResponseBody(
            episode_id=body.episode_id,
            status=outcome.status,
            score=r.score if r is not None else None,
            components=dict(r.components) if r is not None else {},
            error=outcome.error,
            details=r.details if r is not None else "",
        )

    @app.post("/run_code", response_model=RunCodeResult)
    async def run_code(body: RunCodeBody, authorization: str | None = Header(default=None)) -> RunCodeResult:
        check_code_token(authorization, servicer.code_token)
        request = pb.RunCodeRequest(
            code=body.code,
            stdin=body.stdin.encode(),
            timeout_s=body.timeout_s,
            memory_mb=min(body.memory_mb, 2**32 - 1),
        )
        try:
            ran = await servicer.run_code(request)
        except RefusedRun as exc:
            raise HTTPException(status_code=REFUSED_HTTP.get(exc.code, 400), detail=str(exc)) from None
        return RunCodeResult(
            status=status_label(ran),
            exit_code=ran.exit_code,
            stdout=ran.stdout.decode(errors="replace"),
            stderr=ran.stderr.decode(errors="replace"),
            wall_s=ran.wall_s,
            error=ran.error,
        )

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
