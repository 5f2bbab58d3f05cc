"""The agent session endpoint: a small OpenAI-compatible HTTP server inside the rollout process.

Each session has its own base URL, ``http://<host>:<port>/sessions/<session id>/v1``; an agent using the official
``openai`` client (or anything that speaks chat completions) calls ``POST .../chat/completions`` there,
``POST .../completions`` (a text prompt, tokenised as is) and ``GET .../models``. The proxy renders the conversation
to token ids (relayrl.rollout.workflows.agent_chat), forwards them to inference's gRPC Generate, records the call in
the session (agent_session.Call) and answers in OpenAI's shape (plus ``weight_versions`` per choice, as inference's
own REST API does); with ``stream: true`` the same recorded answer as server-sent events (agent_stream.py).

The session id (192 random bits) is the session's only credential: it is never logged, and the proxy binds
loopback by default. An unknown or finished session gets 404; a call over a session limit 413 (not retried by the
openai client); a request body over ``max_body_mib`` 413 before it is read; a refused request 400; a failed
Generate 502 (the openai client retries it; nothing of a failed call is recorded).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from relayrl.common.http import HttpServer
from relayrl.common.openai_sse import MEDIA_TYPE
from relayrl.common.pb import inference_pb2
from relayrl.config.agents import AgentConfig
from relayrl.config.endpoints import HttpConfig
from relayrl.rollout.workflows.agent_chat import ChatError, ChatRequest, Renderer, answer
from relayrl.rollout.workflows.agent_session import Call, Session, SessionLimitExceeded
from relayrl.rollout.workflows.agent_stream import CompletionRequest, completion_answer, stream_events

log = logging.getLogger(__name__)

MODEL_NAME = "relayrl-policy"  # what /models lists; any model name in a request is accepted (agents hard-code one)


@dataclass(frozen=True)
class Sampling:
    """The rollout's sampling settings, applied to every call of every session."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    generate_timeout_s: float = 120.0


@dataclass
class OpenSession:
    session: Session
    inference: Any  # relayrl.client.InferenceClient
    request_id: str  # the group's id, for inference's logs (never the session id)


class SessionProxy:
    """The sessions' HTTP server and registry."""

    def __init__(self, cfg: AgentConfig, renderer: Renderer, sampling: Sampling) -> None:
        self.cfg = cfg
        self.renderer = renderer
        self.sampling = sampling
        self.sessions: dict[str, OpenSession] = {}
        self._server: HttpServer | None = None
        self._lock = asyncio.Lock()
        self.calls_served = 0
        self.calls_refused = 0

    @property
    def port(self) -> int:
        return self._server.port if self._server is not None else 0

    async def start(self) -> None:
        async with self._lock:
            if self._server is None:
                http = replace(HttpConfig(), host=self.cfg.host, port=self.cfg.port, max_body_mib=self.cfg.max_body_mib)
                server = HttpServer(self.app(), http, "agent sessions")
                await server.start()
                self._server = server

    async def stop(self) -> None:
        for entry in self.sessions.values():
            entry.session.closed = True
        self.sessions.clear()
        if self._server is not None:
            await self._server.stop()
            self._server = None

    def open(self, session: Session, inference: Any, request_id: str) -> tuple[str, str]:
        """Register ``session``: its id and its base URL (for the openai client's ``base_url``)."""
        sid = secrets.token_urlsafe(24)
        self.sessions[sid] = OpenSession(session, inference, request_id)
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::", "[::]") else self.cfg.host
        return sid, f"http://{host}:{self.port}/sessions/{sid}/v1"

    def close(self, sid: str) -> None:
        entry = self.sessions.pop(sid, None)
        if entry is not None:
            entry.session.closed = True

    def _entry(self, sid: str) -> OpenSession:
        entry = self.sessions.get(sid)
        if entry is None or entry.session.closed or time.monotonic() > entry.session.deadline:
            raise ChatError("unknown or finished session", None, 404)
        return entry

    @staticmethod
    def _validate(model: type[ChatRequest] | type[CompletionRequest], body: Any) -> Any:
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            errors = exc.errors()
            where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
            msg = errors[0]["msg"] if errors else "invalid request"
            raise ChatError(f"{where}: {msg}", where or None) from None

    async def chat(self, sid: str, body: Any) -> dict[str, Any]:
        """One chat completion of session ``sid``, recorded; the OpenAI answer (streamed by the caller)."""
        entry = self._entry(sid)
        req: ChatRequest = self._validate(ChatRequest, body)
        req.check(self.sampling.temperature, self.sampling.top_p)
        prompt_ids = await asyncio.to_thread(self.renderer.prompt_ids, req, entry.session.tails())
        gen, sample = await self._generate(entry, prompt_ids, req.max_completion_tokens or req.max_tokens,
                                           req.stops(), req.seed, [m.turn() for m in req.messages])
        pieces = [self.renderer.decode([t]) for t in sample.token_ids] if req.logprobs else []
        return answer(req, sample, req.model or MODEL_NAME, len(gen.prompt_token_ids), pieces)

    async def complete(self, sid: str, body: Any) -> dict[str, Any]:
        """One text completion of session ``sid`` (its prompt tokenised as is, earlier tokens reused), recorded."""
        entry = self._entry(sid)
        req: CompletionRequest = self._validate(CompletionRequest, body)
        req.check(self.sampling.temperature, self.sampling.top_p)
        text = req.text()
        prompt_ids = await asyncio.to_thread(self.renderer.prompt_ids, text, entry.session.tails())
        gen, sample = await self._generate(entry, prompt_ids, req.max_tokens, req.stops(), req.seed,
                                           [{"role": "prompt", "content": text}])
        pieces = [self.renderer.decode([t]) for t in sample.token_ids] if req.logprobs is not None else []
        return completion_answer(req, sample, req.model or MODEL_NAME, len(gen.prompt_token_ids), pieces)

    async def _generate(self, entry: OpenSession, prompt_ids: list[int], max_tokens: int | None, stops: list[str],
                        seed: int | None, messages: list[dict[str, Any]]) -> tuple[Any, Any]:
        """Generate one sample within the session's limits and record it: (GenerateResponse, its sample)."""
        s, session = self.sampling, entry.session
        try:
            plan = session.plan(prompt_ids, max_tokens)
        except SessionLimitExceeded as exc:
            raise ChatError(str(exc), None, 413) from None
        sampling = inference_pb2.SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                                max_new_tokens=plan.max_new_tokens, stop=[*s.stop, *stops])
        if seed is not None:
            sampling.seed = seed
        timeout = min(s.generate_timeout_s, max(0.1, session.deadline - time.monotonic()))
        try:
            gen = await entry.inference.generate(prompt_ids, sampling, timeout_s=timeout, request_id=entry.request_id)
        except grpc.aio.AioRpcError as exc:
            session.release(plan)
            status = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 413}.get(exc.code(),
                                                                                                        502)
            raise ChatError(f"inference: {exc.code().name}: {exc.details()}", None, status) from None
        except BaseException:
            session.release(plan)
            raise
        [sample] = gen.samples
        if session.closed:  # the session ended while the model sampled: nothing is recorded
            session.release(plan)
            raise ChatError("unknown or finished session", None, 404)
        session.record(plan, Call(list(gen.prompt_token_ids), list(sample.token_ids), list(sample.logprobs),
                                  list(sample.weight_versions), sample.finish_reason, sample.text, messages))
        self.calls_served += 1
        return gen, sample

    def app(self) -> FastAPI:
        app = FastAPI(title="relayrl agent sessions", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ChatError)
        async def _refused(_: Request, exc: ChatError) -> JSONResponse:
            self.calls_refused += 1
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.get("/sessions/{sid}/v1/models")
        async def models(sid: str) -> dict[str, Any]:
            self._entry(sid)
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0,
                                                "owned_by": "relayrl"}]}

        async def serve(sid: str, request: Request, call: Any) -> Any:
            self._entry(sid)  # an unknown session is 404 whatever its body
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ChatError(f"the body is not JSON: {exc}") from None
            result = await call(sid, body)  # generated and recorded before any byte is sent: errors stay HTTP errors
            if not (isinstance(body, dict) and body.get("stream") is True):
                return result
            events = stream_events(result, bool((body.get("stream_options") or {}).get("include_usage")))
            return StreamingResponse(iter(events), media_type=MEDIA_TYPE, headers={"Cache-Control": "no-cache"})

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat(sid: str, request: Request) -> Any:
            return await serve(sid, request, self.chat)

        @app.post("/sessions/{sid}/v1/completions")
        async def completions(sid: str, request: Request) -> Any:
            return await serve(sid, request, self.complete)

        return app
