"""The inference service's HTTP app: the OpenAI-compatible routes (relayrl.inference.http's handlers, streamed by
relayrl.inference.http_stream), /healthz and /metrics, with OpenAI-shaped errors."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from relayrl.inference.http import OpenAiApi
from relayrl.inference.http_stream import stream_chat, stream_completions
from relayrl.inference.openai_schema import ApiError, ChatRequest, CompletionRequest, error_response
from relayrl.inference.serving import InferenceService


def create_app(service: InferenceService) -> FastAPI:
    app = FastAPI(title="relayrl inference", version="1", docs_url=None, redoc_url=None)
    api = OpenAiApi(service)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        service.metrics.request_errors.labels("openai", str(exc.status)).inc()
        return error_response(exc.status, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        service.metrics.request_errors.labels("openai", "400").inc()
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"unsupported field {where!r}: relayrl does not implement it", where)
        value = first.get("input")
        shown = (
            f"={value!r}"
            if isinstance(value, int | float | bool) or (isinstance(value, str) and len(value) < 40)
            else ""
        )
        return error_response(400, f"{where}{shown}: {first.get('msg', 'invalid request')}", where or None)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "weight_version": service.engine.version}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return api.models()

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest) -> dict[str, Any] | StreamingResponse:
        if req.stream:
            return _sse(stream_completions(api, req, await api.completion_inputs(req)))
        return await api.completions(req)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatRequest) -> dict[str, Any] | StreamingResponse:
        if req.stream:
            return _sse(stream_chat(api, req, await api.chat_input(req)))
        return await api.chat(req)

    return app


def _sse(events: Any) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
