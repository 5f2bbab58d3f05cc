"""The agent session endpoint: a small OpenAI-compatible HTTP server inside the rollout process.

Each session has its own base URL, ``http://<host>:<port>/sessions/<session id>/v1``; an agent using the official
``openai`` client (or anything that speaks chat completions) calls ``POST .../chat/completions`` there,
``POST .../completions`` (a text prompt, tokenised as is) and ``GET .../models``. The proxy renders the conversation
to token ids (relayrl.rollout.workflows.agent_chat), forwards them to inference's gRPC Generate, records the call in
the session (agent_session.Call) and answers in OpenAI's shape (plus ``weight_versions`` per choice, as inference's
own REST API does); with ``stream: true`` it forwards inference's GenerateStream as server-sent events, token by
token, and records the call when its sample is finished (agent_stream.py).

The session id (192 random bits) is the session's only credential: it is never logged, and the proxy binds
loopback by default. An unknown or finished session gets 404; a call over a session limit 413 (not retried by the
openai client); a request body over ``max_body_mib`` 413 before it is read; a refused request 400; a failed
Generate 502 (the openai client retries it; nothing of a failed call is recorded). A streamed call that fails
after its first event, or whose client goes away mid-stream or before its first event, is not recorded either: its
error is the stream's last event, its token budget is released (it still counts against ``max_calls``) and
inference cancels its request; the session's recorded calls and chains are as before it, so the agent's next call
(its history holding the text it did receive, or not) extends them or starts a new chain like any other.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from relayrl.common.http import HttpServer
from relayrl.common.openai_sse import MEDIA_TYPE, sse
from relayrl.common.pb import inference_pb2
from relayrl.config.agents import AgentConfig
from relayrl.config.endpoints import HttpConfig
from relayrl.rollout.workflows.agent_chat import ChatError, ChatRequest, Renderer, answer
from relayrl.rollout.workflows.agent_session import Call, Plan, Session, SessionLimitExceeded
from relayrl.rollout.workflows.agent_stream import (
    ClosingStreamingResponse,
    CompletionRequest,
    SseWriter,
    StreamEnd,
    completion_answer,
)

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


@dataclass
class Prepared:
    """A call's checked request, before it is admitted: its session, prompt ids and token ask."""

    entry: OpenSession
    req: ChatRequest | CompletionRequest
    prompt_ids: list[int]
    max_tokens: int | None
    messages: list[dict[str, Any]]  # the request's messages (for the episode's prompt text)


def refused(exc: grpc.aio.AioRpcError) -> ChatError:
    """A failed inference call as the session's HTTP error: 400 refused, 413 over a limit, else 502."""
    status = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 413}.get(exc.code(), 502)
    return ChatError(f"inference: {exc.code().name}: {exc.details()}", None, status)


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

    async def _prepare(self, sid: str, body: Any, chat: bool) -> Prepared:
        """A call's checked request and its prompt ids (a chat rendered, a text prompt tokenised as is, both
        reusing the session's earlier tokens)."""
        entry = self._entry(sid)
        req = self._validate(ChatRequest if chat else CompletionRequest, body)
        req.check(self.sampling.temperature, self.sampling.top_p)
        if isinstance(req, ChatRequest):
            prompt_ids = await asyncio.to_thread(self.renderer.prompt_ids, req, entry.session.tails())
            return Prepared(
                entry, req, prompt_ids, req.max_completion_tokens or req.max_tokens, [m.turn() for m in req.messages]
            )
        text = req.text()
        prompt_ids = await asyncio.to_thread(self.renderer.prompt_ids, text, entry.session.tails())
        return Prepared(entry, req, prompt_ids, req.max_tokens, [{"role": "prompt", "content": text}])

    def _answer(self, p: Prepared, sample: Any, prompt_tokens: int) -> dict[str, Any]:
        """The OpenAI answer (chat or text completion) of a recorded call."""
        req, model = p.req, p.req.model or MODEL_NAME
        if isinstance(req, ChatRequest):
            pieces = [self.renderer.decode([t]) for t in sample.token_ids] if req.logprobs else []
            return answer(req, sample, model, prompt_tokens, pieces)
        pieces = [self.renderer.decode([t]) for t in sample.token_ids] if req.logprobs is not None else []
        return completion_answer(req, sample, model, prompt_tokens, pieces)

    async def chat(self, sid: str, body: Any) -> dict[str, Any]:
        """One chat completion of session ``sid``, recorded; the OpenAI answer."""
        p = await self._prepare(sid, body, chat=True)
        gen, sample = await self._generate(p)
        return self._answer(p, sample, len(gen.prompt_token_ids))

    async def complete(self, sid: str, body: Any) -> dict[str, Any]:
        """One text completion of session ``sid`` (its prompt tokenised as is, earlier tokens reused), recorded."""
        p = await self._prepare(sid, body, chat=False)
        gen, sample = await self._generate(p)
        return self._answer(p, sample, len(gen.prompt_token_ids))

    def _admit(self, p: Prepared) -> tuple[Plan, inference_pb2.SamplingParams, float]:
        """Admit a call within the session's limits (413 otherwise): its plan, sampling and deadline."""
        s, session = self.sampling, p.entry.session
        try:
            plan = session.plan(p.prompt_ids, p.max_tokens)
        except SessionLimitExceeded as exc:
            raise ChatError(str(exc), None, 413) from None
        sampling = inference_pb2.SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_new_tokens=plan.max_new_tokens,
            stop=[*s.stop, *p.req.stops()],
        )
        if p.req.seed is not None:
            sampling.seed = p.req.seed
        return plan, sampling, min(s.generate_timeout_s, max(0.1, session.deadline - time.monotonic()))

    def _record(self, p: Prepared, plan: Plan, prompt_ids: list[int], sample: Any) -> None:
        """Record a finished call in its session (404 and nothing recorded when the session ended meanwhile: the
        caller releases the plan)."""
        session = p.entry.session
        if session.closed:  # the session ended while the model sampled: nothing is recorded
            raise ChatError("unknown or finished session", None, 404)
        session.record(
            plan,
            Call(
                prompt_ids,
                list(sample.token_ids),
                list(sample.logprobs),
                list(sample.weight_versions),
                sample.finish_reason,
                sample.text,
                p.messages,
            ),
        )
        self.calls_served += 1

    async def _generate(self, p: Prepared) -> tuple[Any, Any]:
        """Generate one sample within the session's limits and record it: (GenerateResponse, its sample)."""
        plan, sampling, timeout = self._admit(p)
        try:
            gen = await p.entry.inference.generate(
                p.prompt_ids, sampling, timeout_s=timeout, request_id=p.entry.request_id
            )
        except grpc.aio.AioRpcError as exc:
            p.entry.session.release(plan)
            raise refused(exc) from None
        except BaseException:
            p.entry.session.release(plan)
            raise
        [sample] = gen.samples
        try:
            self._record(p, plan, list(gen.prompt_token_ids), sample)
        except ChatError:
            p.entry.session.release(plan)
            raise
        return gen, sample

    async def stream(self, sid: str, body: Any, chat: bool) -> tuple[AsyncIterator[str], StreamEnd]:
        """A streamed call: GenerateStream is open and has accepted the request (errors so far are HTTP errors);
        the events leave as its chunks arrive (see agent_stream.py), and the call is recorded when it finishes.
        Returns the events and the call's end, which the response closes however it ends."""
        p = await self._prepare(sid, body, chat)
        plan, sampling, timeout = self._admit(p)
        call = p.entry.inference.generate_stream(
            p.prompt_ids, sampling, timeout_s=timeout, request_id=p.entry.request_id
        )
        try:
            first = await anext(aiter(call))
        except grpc.aio.AioRpcError as exc:
            p.entry.session.release(plan)
            raise refused(exc) from None
        except BaseException:
            p.entry.session.release(plan)
            call.cancel()
            raise
        usage = bool(p.req.stream_options and p.req.stream_options.include_usage)
        writer = SseWriter(
            p.req,
            chat,
            p.req.model or MODEL_NAME,
            self.renderer.text_of,
            lambda t: self.renderer.decode([t]),
            [*self.sampling.stop, *p.req.stops()],
        )
        end = StreamEnd(p.entry.session, plan, call)
        return self._events(p, end, list(first.prompt_token_ids), writer, usage), end

    async def _events(
        self, p: Prepared, end: StreamEnd, prompt_ids: list[int], writer: SseWriter, usage: bool
    ) -> AsyncIterator[str]:
        """The events of a streamed call. A client that goes away (or a failed stream) ends it unrecorded: the
        call's budget is released, it still counts as a call, and inference cancels the request."""
        plan, call = end.plan, end.call
        try:
            for event in writer.start():
                yield event
            async for chunk in call:
                if chunk.HasField("sample"):
                    self._record(p, plan, prompt_ids, chunk.sample)
                    end.recorded = True
                    for event in writer.finish(self._answer(p, chunk.sample, len(prompt_ids)), chunk.sample, usage):
                        yield event
                    return
                for event in writer.add(list(chunk.token_ids), list(chunk.logprobs), list(chunk.weight_versions)):
                    yield event
            raise ChatError("inference: the stream ended before the sample", None, 502)
        except (ChatError, grpc.aio.AioRpcError) as exc:
            error = exc if isinstance(exc, ChatError) else refused(exc)
            self.calls_refused += 1
            yield sse(error.body())
        finally:
            end.close()

    def app(self) -> FastAPI:
        app = FastAPI(title="relayrl agent sessions", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ChatError)
        async def _refused(_: Request, exc: ChatError) -> JSONResponse:
            self.calls_refused += 1
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.get("/sessions/{sid}/v1/models")
        async def models(sid: str) -> dict[str, Any]:
            self._entry(sid)
            return {
                "object": "list",
                "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "relayrl"}],
            }

        async def serve(sid: str, request: Request, chat: bool) -> Any:
            self._entry(sid)  # an unknown session is 404 whatever its body
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ChatError(f"the body is not JSON: {exc}") from None
            if isinstance(body, dict) and body.get("stream") is True:  # errors before the first event stay HTTP
                events, end = await self.stream(sid, body, chat)
                return ClosingStreamingResponse(
                    events, end.close, media_type=MEDIA_TYPE, headers={"Cache-Control": "no-cache"}
                )
            return await (self.chat(sid, body) if chat else self.complete(sid, body))

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat(sid: str, request: Request) -> Any:
            return await serve(sid, request, True)

        @app.post("/sessions/{sid}/v1/completions")
        async def completions(sid: str, request: Request) -> Any:
            return await serve(sid, request, False)

        return app
