"""OpenAI-compatible REST API of the inference service (FastAPI): /v1/models, /v1/completions,
/v1/chat/completions, plus /healthz and /metrics (Prometheus).

Beside the OpenAI fields, every choice carries ``weight_versions`` (the version that produced each token) and
every response ``weight_version`` (the oldest version among its tokens, i.e. how stale the response can be).
Logprobs are those of the sampled tokens under the full tempered softmax (see relayrl.inference.engine);
alternatives (``top_logprobs`` > 0) are not computed and are refused, as are ``stream`` and ``echo``.
Chat prompts use the tokenizer's chat template, or, when it has none, ``"{role}: {content}\\n"`` per message
followed by ``"assistant: "``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH
from relayrl.inference.engine import GenerationInput, SampleOutput
from relayrl.inference.serving import InferenceService, LimitExceeded


class _Sampling(BaseModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # vLLM-style extension
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status

    @classmethod
    def refused(cls, exc: ValueError, param: str | None = None) -> ApiError:
        """The service's refusal as an API error: 400, or the limit's own status (413, 429)."""
        return cls(str(exc), param, exc.http_status if isinstance(exc, LimitExceeded) else 400)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": None}})


def _finish(s: SampleOutput) -> str:
    return "length" if s.finish_reason == FINISH_REASON_LENGTH else "stop"


class OpenAiApi:
    """The handlers of the OpenAI-compatible routes over one :class:`InferenceService`."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    def generation_input(self, req: _Sampling, ids: list[int], max_tokens: int | None) -> GenerationInput:
        """The engine's input for one prompt of a request; ApiError for a request the engine would refuse."""
        service = self.service
        if req.stream:
            raise ApiError("stream=true is not supported", "stream")
        if req.model not in (None, "", service.model_name):
            raise ApiError(f"model {req.model!r} is not served here (this server serves {service.model_name!r})",
                           "model", 404)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        inp = GenerationInput(
            prompt_ids=ids, n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            max_new_tokens=max_tokens or 16, stop=stop, stop_token_ids=list(req.stop_token_ids), seed=req.seed,
            ignore_eos=req.ignore_eos)
        if req.temperature == 0:  # greedy, as OpenAI defines temperature 0
            inp.temperature, inp.top_k = 1.0, 1
        try:
            return service.check(inp)
        except ValueError as exc:
            raise ApiError.refused(exc) from exc

    async def run(self, inputs: list[GenerationInput]) -> list[list[SampleOutput]]:
        """Submit every input (all or none: a refused one cancels those already queued), then wait for all."""
        submitted = []
        try:
            for inp in inputs:
                submitted.append(self.service.submit(inp))
        except ValueError as exc:
            for future, _ in submitted:
                future.cancel()
            raise ApiError.refused(exc) from exc
        return list(await asyncio.gather(*(self.service.result(s, "openai") for s in submitted)))

    def oldest(self, results: list[list[SampleOutput]]) -> int:
        versions = [min(s.weight_versions) for r in results for s in r if s.weight_versions]
        return min(versions) if versions else self.service.engine.version

    def pieces(self, s: SampleOutput) -> list[str]:
        return [self.service.tokenizer.decode([t]) for t in s.token_ids]

    async def prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        """A completion request's prompt(s) as token ids."""
        if isinstance(prompt, str):
            return [await _tokens(self.service, prompt)]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [[int(p) for p in prompt]]  # type: ignore[arg-type]
        if prompt and all(isinstance(p, str) for p in prompt):
            return [await _tokens(self.service, str(p)) for p in prompt]
        if prompt and all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt]  # type: ignore[arg-type]
        raise ApiError("prompt must be a string, a list of strings, or token ids", "prompt")

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.service.model_name, "object": "model", "created": 0,
                                            "owned_by": "relayrl", "weight_version": self.service.engine.version}]}

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        if req.echo:
            raise ApiError("echo=true is not supported", "echo")
        if req.logprobs:
            raise ApiError("alternatives are not computed: use logprobs=0 for the sampled tokens' logprobs",
                           "logprobs")
        count = len(req.prompt) if isinstance(req.prompt, list) and not all(
            isinstance(p, int) for p in req.prompt) else 1  # checked before any prompt is tokenised
        if count * req.n > self.service.cfg.max_samples_per_request:
            raise ApiError(f"{count} prompts x n={req.n} is over max_samples_per_request="
                           f"{self.service.cfg.max_samples_per_request}", "prompt", 413)
        inputs = [self.generation_input(req, ids, req.max_tokens) for ids in await self.prompts(req.prompt)]
        results = await self.run(inputs)
        choices: list[dict[str, Any]] = []
        for samples in results:
            for s in samples:
                choice: dict[str, Any] = {"index": len(choices), "text": s.text, "finish_reason": _finish(s),
                                          "logprobs": None, "weight_versions": s.weight_versions}
                if req.logprobs is not None:
                    pieces = self.pieces(s)
                    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
                    choice["logprobs"] = {"tokens": pieces, "token_logprobs": s.logprobs, "top_logprobs": None,
                                          "text_offset": offsets}
                choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.service.model_name, "choices": choices, "usage": _usage(inputs, results),
                "weight_version": self.oldest(results)}

    async def chat(self, req: ChatRequest) -> dict[str, Any]:
        if req.top_logprobs:
            raise ApiError("alternatives are not computed: top_logprobs must be 0", "top_logprobs")
        ids = await _tokens(self.service, _chat_prompt(self.service.tokenizer, req.messages))
        inp = self.generation_input(req, ids, req.max_completion_tokens or req.max_tokens)
        [samples] = await self.run([inp])
        choices: list[dict[str, Any]] = []
        for i, s in enumerate(samples):
            logprobs = None
            if req.logprobs:
                logprobs = {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                                        for p, lp in zip(self.pieces(s), s.logprobs, strict=True)]}
            choices.append({"index": i, "message": {"role": "assistant", "content": s.text},
                            "finish_reason": _finish(s), "logprobs": logprobs, "weight_versions": s.weight_versions})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.service.model_name, "choices": choices, "usage": _usage([inp], [samples]),
                "weight_version": self.oldest([samples])}


def create_app(service: InferenceService) -> FastAPI:
    app = FastAPI(title="relayrl inference", version="1", docs_url=None, redoc_url=None)
    api = OpenAiApi(service)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        service.metrics.request_errors.labels("openai", str(exc.status)).inc()
        return _error(exc.status, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        service.metrics.request_errors.labels("openai", "400").inc()
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}", where or None)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "weight_version": service.engine.version}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return api.models()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict[str, Any]:
        return await api.completions(req)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> dict[str, Any]:
        return await api.chat(req)

    return app


def _usage(inputs: list[GenerationInput], results: list[list[SampleOutput]]) -> dict[str, int]:
    prompt = sum(len(i.prompt_ids) for i in inputs)
    completion = sum(len(s.token_ids) for r in results for s in r)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _tokens(service: InferenceService, text: str) -> list[int]:
    try:
        return await asyncio.to_thread(service.tokenize, text)  # CPU work: off the event loop
    except ValueError as exc:
        raise ApiError.refused(exc, "prompt") from exc


def _chat_prompt(tokenizer: Any, messages: list[ChatMessage]) -> str:
    turns = [{"role": m.role, "content": m.content} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant: "
