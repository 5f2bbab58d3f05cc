"""The chat side of the agent session endpoint: request bodies (the subset of OpenAI's chat completions a session
honours), rendering a conversation to the token ids the model sees, and the OpenAI-shaped answer.

Rendering is token-in/token-out: the conversation is rendered with the served model's chat template (the same
tokenizer files inference loads), and where the rendered text starts with the text of an earlier call's prompt and
completion, that call's ids are reused verbatim and only the rest is tokenised. The model thus sees exactly the
tokens it sampled before, never a re-tokenisation of their text, and the call extends the same episode.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from relayrl.common.openai_messages import Strict, TextPart, ToolCallIn
from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH
from relayrl.common.tool_calls import ToolCall, chat_template_text, parse_tool_calls


class ChatError(Exception):
    """A refused request: its HTTP status, message and the parameter to blame (OpenAI's error shape)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        code = {404: "session_not_found", 413: "session_limit_exceeded"}.get(self.status)
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": code}}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients echo response-only keys (refusal, annotations) back
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def turn(self) -> dict[str, Any]:
        """The message as a chat template reads it (tool-call arguments as objects)."""
        text = "".join(p.text for p in self.content) if isinstance(self.content, list) else (self.content or "")
        turn: dict[str, Any] = {"role": self.role, "content": text}
        if self.name is not None:
            turn["name"] = self.name
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            try:
                turn["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": (
                                json.loads(c.function.arguments)
                                if isinstance(c.function.arguments, str)
                                else c.function.arguments
                            ),
                        },
                    }
                    for c in self.tool_calls
                ]
            except json.JSONDecodeError as exc:
                raise ChatError(f"a tool call's function.arguments is not JSON: {exc}", "messages") from exc
        return turn


class StreamOptions(Strict):
    include_usage: bool = False


class SessionRequest(Strict):
    """The sampling fields every call of a session shares (chat and text completions). Sampling is the rollout's
    (temperature, top_p, top_k): the logprobs must be the policy's at the temperature the trainer uses, so a
    request may repeat those values but not change them."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def check(self, temperature: float, top_p: float) -> None:
        if self.n != 1:
            raise ChatError("n must be 1 in an agent session (one call, one sample)", "n")
        if self.stream_options is not None and not self.stream:
            raise ChatError("stream_options is only allowed with stream=true", "stream_options")
        if self.temperature is not None and abs(self.temperature - temperature) > 1e-6:
            raise ChatError(
                f"temperature must be the rollout's ({temperature}) or left out: the episode's logprobs "
                "are the policy's at that temperature",
                "temperature",
            )
        if self.top_p is not None and abs(self.top_p - top_p) > 1e-6:
            raise ChatError(f"top_p must be the rollout's ({top_p}) or left out", "top_p")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(SessionRequest):
    """What a session accepts on /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def check(self, temperature: float, top_p: float) -> None:
        super().check(temperature, top_p)
        if self.top_logprobs:
            raise ChatError("top_logprobs is not supported in an agent session", "top_logprobs")


class Renderer:
    """A conversation to prompt ids with the served model's tokenizer (see the module's docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, req: ChatRequest) -> str:
        turns = [m.turn() for m in req.messages]
        tools = req.tools if req.uses_tools() else None
        template = chat_template_text(self.tokenizer)
        tool_turns = any(t["role"] == "tool" or "tool_calls" in t for t in turns)
        if (tools or tool_turns) and "tools" not in template:
            raise ChatError("this model's chat template cannot render tools or tool messages", "tools")
        if not template:  # inference's own fallback for a tokenizer without a template
            return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant: "
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        try:
            return str(self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False, **kwargs))
        except Exception as exc:  # a template that raises on these messages
            raise ChatError(f"the model's chat template refused these messages: {exc}", "messages") from exc

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)] if text else []

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def text_of(self, ids: list[int]) -> str:
        """A sample's text as inference decodes it (special tokens left out)."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def prompt_ids(self, req: ChatRequest | str, tails: list[list[int]]) -> list[int]:
        """The request's prompt ids (a chat request rendered, or a completion's text as is), reusing the first tail
        (earlier tokens of the session) whose text starts the prompt."""
        text = req if isinstance(req, str) else self.text(req)
        for tail in tails:
            prefix = self.decode(tail)
            if text.startswith(prefix):
                return tail + self.encode(text[len(prefix) :])
        return self.encode(text)


def answer(req: ChatRequest, sample: Any, model: str, prompt_tokens: int, pieces: list[str]) -> dict[str, Any]:
    """The OpenAI chat completion for one sample (``pieces``: the text of each sampled token, for logprobs)."""
    text = sample.text
    calls: list[ToolCall] = []
    if req.uses_tools():
        text, calls = parse_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    finish = "tool_calls" if calls else ("length" if sample.finish_reason == FINISH_REASON_LENGTH else "stop")
    logprobs = None
    if req.logprobs:
        logprobs = {
            "content": [
                {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                for p, lp in zip(pieces, sample.logprobs, strict=True)
            ]
        }
    versions = [int(v) for v in sample.weight_versions]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "weight_version": min(versions) if versions else 0,
        "choices": [
            {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs, "weight_versions": versions}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(sample.token_ids),
            "total_tokens": prompt_tokens + len(sample.token_ids),
        },
    }
