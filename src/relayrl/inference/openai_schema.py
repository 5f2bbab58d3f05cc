"""Request bodies of the OpenAI-compatible REST API, and its errors.

Every field OpenAI defines that relayrl does not implement is refused with a 400 naming it: a field that is not
declared here is refused by validation (``extra="forbid"``); a declared one whose value would change the result
in a way relayrl cannot honour (a penalty, a logit bias, a JSON response format, ...) is refused by
:func:`refuse_unsupported`. Only values that mean "the default" are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from relayrl.common.openai_messages import Strict, TextPart, ToolCallIn
from relayrl.inference.sampling_limits import MAX_ALTERNATIVES, LimitExceeded


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status

    @classmethod
    def refused(cls, exc: ValueError, param: str | None = None) -> ApiError:
        """The service's refusal as an API error: 400, or the limit's own status (413, 429)."""
        return cls(str(exc), param, exc.http_status if isinstance(exc, LimitExceeded) else 400)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = {404: "model_not_found", 413: "request_too_large", 429: "rate_limit_exceeded"}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, param))


class StreamOptions(Strict):
    include_usage: bool = False


class _Sampling(Strict):
    # types only: the ranges of the sampling fields (max_tokens, temperature, top_p, top_k, n, stop, ...) are
    # relayrl.inference.sampling_limits', the rules gRPC requests meet too
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM-style extension
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)  # vLLM-style extension
    seed: int | None = None
    ignore_eos: bool = False  # vLLM-style extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id: accepted, not used
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_ALTERNATIVES)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


class ChatMessage(BaseModel):
    # extra keys that clients echo back from a response (refusal, annotations, audio: None) are accepted only
    # when empty; see refuse_unsupported
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_ALTERNATIVES)
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


def _refuse_sampling(req: _Sampling) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) != 0:  # NaN and +/-Infinity too
            raise ApiError(
                f"{name}={getattr(req, name)!r} is not supported (only 0): relayrl samples from the "
                "model's own distribution so that its logprobs are the policy's",
                name,
            )
    if req.logit_bias:
        raise ApiError("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise ApiError("stream_options is only allowed with stream=true", "stream_options")


def refuse_unsupported(req: CompletionRequest | ChatRequest) -> None:
    """ApiError naming the first field whose value relayrl cannot honour."""
    _refuse_sampling(req)
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1, req.n):
            raise ApiError("best_of is not supported (only best_of=n: every sample is returned)", "best_of")
        if req.suffix:
            raise ApiError("suffix (insertion) is not supported", "suffix")
        return
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise ApiError(
            "response_format is not supported (only {'type': 'text'}): no constrained decoding", "response_format"
        )
    if req.tool_choice is not None and req.tool_choice not in ("auto", "none"):
        raise ApiError("tool_choice must be 'auto' or 'none': relayrl does not force a tool call", "tool_choice")
    if req.top_logprobs and not req.logprobs:
        raise ApiError("top_logprobs needs logprobs=true", "top_logprobs")
    for i, m in enumerate(req.messages):
        for key, value in (m.model_extra or {}).items():
            if value not in (None, [], {}, ""):
                raise ApiError(f"messages[{i}].{key} is not supported", f"messages.{i}.{key}")
