"""The agent session endpoint's ``/v1/completions`` and its streamed answers (``stream: true``, server-sent events
in OpenAI's chunk format, as inference's own REST API sends them: relayrl.common.openai_sse).

A streamed call uses inference's GenerateStream: the response starts once inference has accepted the request (its
first message: the prompt's ids), so a refused request is still an HTTP error; then each token's text leaves as a
chunk as soon as it is sampled (:class:`SseWriter`): for chat a first chunk with the assistant role, then chunks
with the new text, the logprobs of its tokens when asked and their ``weight_versions`` (a token whose text is not
complete yet, a part of a UTF-8 character, waits for the next), then a last chunk with the rest of the text, the
``finish_reason`` (and the parsed ``tool_calls``) and the answer's ``weight_version``, a usage chunk with
``stream_options.include_usage``, then ``[DONE]``. The text is the one a non-streamed call answers: it ends after
a stop string, like inference's sample text. A chat request with tools streams its text in the last chunk (its
tool calls must be parsed from the whole text), but is generated the same way.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import Field
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from relayrl.common.openai_sse import DONE, sse
from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH
from relayrl.rollout.workflows.agent_chat import ChatError, ChatRequest, SessionRequest
from relayrl.rollout.workflows.agent_session import Plan, Session

log = logging.getLogger(__name__)


class CompletionRequest(SessionRequest):
    """What a session accepts on /v1/completions: one text prompt, the rollout's sampling (like chat)."""

    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default
    logprobs: int | None = Field(default=None, ge=0, le=0)  # chosen tokens' logprobs only (no alternatives)
    echo: bool = False

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ChatError("prompt must be one string in an agent session (one call, one sample)", "prompt")
            return self.prompt[0]
        return self.prompt

    def check(self, temperature: float, top_p: float) -> None:
        super().check(temperature, top_p)
        if self.echo:
            raise ChatError("echo is not supported in an agent session", "echo")


def completion_answer(
    req: CompletionRequest, sample: Any, model: str, prompt_tokens: int, pieces: list[str]
) -> dict[str, Any]:
    """The OpenAI text completion for one sample (``pieces``: the text of each sampled token, for logprobs)."""
    logprobs = None
    if req.logprobs is not None:
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += len(p)
        logprobs = {
            "tokens": pieces,
            "token_logprobs": list(sample.logprobs),
            "top_logprobs": None,
            "text_offset": offsets,
        }
    versions = [int(v) for v in sample.weight_versions]
    finish = "length" if sample.finish_reason == FINISH_REASON_LENGTH else "stop"
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "weight_version": min(versions) if versions else 0,
        "choices": [
            {
                "index": 0,
                "text": sample.text,
                "finish_reason": finish,
                "logprobs": logprobs,
                "weight_versions": versions,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(sample.token_ids),
            "total_tokens": prompt_tokens + len(sample.token_ids),
        },
    }


def cut_at_stop(text: str, stops: list[str]) -> str:
    """``text`` up to the end of its first stop string (where inference cuts a sample's text)."""
    ends = [text.find(x) + len(x) for x in stops if x in text]
    return text[: min(ends)] if ends else text


class SseWriter:
    """The server-sent events of one streamed call, built as inference's chunks arrive (see the module's
    docstring). ``text_of``: token ids to text as inference decodes a sample; ``piece``: one token's text."""

    def __init__(
        self,
        req: SessionRequest,
        chat: bool,
        model: str,
        text_of: Callable[[list[int]], str],
        piece: Callable[[int], str],
        stops: list[str],
    ) -> None:
        self.req, self.chat, self.text_of, self.piece, self.stops = req, chat, text_of, piece, stops
        self.head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self.logprobs = bool(getattr(req, "logprobs", None)) if chat else getattr(req, "logprobs", None) is not None
        self.buffer = chat and isinstance(req, ChatRequest) and req.uses_tools()
        self.tokens: list[int] = []
        self.lps: list[float] = []
        self.versions: list[int] = []
        self.sent_text = ""
        self.sent_tokens = 0

    def event(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({**self.head, "choices": choices, **extra})

    def start(self) -> list[str]:
        """The chat's first chunk (the assistant's role); none for a text completion."""
        return (
            [
                self.event(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            ]
            if self.chat
            else []
        )

    def add(self, ids: list[int], lps: list[float], versions: list[int]) -> list[str]:
        """A chunk for newly sampled tokens, once they add text (held while buffering for tool calls)."""
        self.tokens += ids
        self.lps += lps
        self.versions += versions
        if self.buffer:
            return []
        text = cut_at_stop(self.text_of(self.tokens).rstrip("\ufffd"), self.stops)
        if len(text) <= len(self.sent_text) or not text.startswith(self.sent_text):
            return []  # nothing new yet (or a re-decoding that changed earlier text: the last chunk settles it)
        return [self.event([self._choice(text[len(self.sent_text) :])])]

    def _choice(self, text: str, finish: str | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """One chunk's choice: ``text`` and the tokens not sent yet (their logprobs when asked, their versions)."""
        ids, lps = self.tokens[self.sent_tokens :], self.lps[self.sent_tokens :]
        logprobs: dict[str, Any] | None = None
        if self.logprobs:
            pieces = [self.piece(t) for t in ids]
            if self.chat:
                logprobs = {
                    "content": [
                        {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                        for p, lp in zip(pieces, lps, strict=True)
                    ]
                }
            else:
                offsets, at = [], len(self.sent_text)
                for p in pieces:
                    offsets.append(at)
                    at += len(p)
                logprobs = {"tokens": pieces, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}
        out: dict[str, Any] = {
            "index": 0,
            "logprobs": logprobs,
            "finish_reason": finish,
            "weight_versions": self.versions[self.sent_tokens :],
        }
        if self.chat:
            out["delta"] = {"content": text, **(extra or {})} if text or extra else {}
        else:
            out["text"] = text
        self.sent_text += text
        self.sent_tokens = len(self.tokens)
        return out

    def finish(self, answer: dict[str, Any], sample: Any, usage: bool) -> list[str]:
        """The last events, from the recorded call's (non-streamed) ``answer`` and the finished ``sample``."""
        self.tokens, self.lps = [int(t) for t in sample.token_ids], list(sample.logprobs)
        self.versions = [int(v) for v in sample.weight_versions]  # authoritative: the sample inference finished
        [choice] = answer["choices"]
        extra = None
        if self.chat:
            final = choice["message"]["content"] or ""
            if choice["message"].get("tool_calls"):
                extra = {"tool_calls": [{**c, "index": k} for k, c in enumerate(choice["message"]["tool_calls"])]}
        else:
            final = choice["text"]
        if not final.startswith(self.sent_text):
            log.warning("streamed text diverged from the sample's text; sending the rest of the sample's only")
        rest = final[len(self.sent_text) :] if final.startswith(self.sent_text) else ""
        events = [
            self.event([self._choice(rest, choice["finish_reason"], extra)], weight_version=answer["weight_version"])
        ]
        if usage:
            events.append(self.event([], usage=answer["usage"], weight_version=answer["weight_version"]))
        events.append(DONE)
        return events


class StreamEnd:
    """How a streamed call ends, exactly once: recorded (its sample finished), or its token budget released; the
    inference request is cancelled either way (a no-op once it finished)."""

    def __init__(self, session: Session, plan: Plan, call: Any) -> None:
        self.session, self.plan, self.call = session, plan, call
        self.recorded = False
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.recorded:
            self.session.release(self.plan)
        self.call.cancel()


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however it ends: finished, failed, or its client gone before the
    first event, when Starlette never starts the body iterator (a send that fails, or a cancelled stream) and the
    iterator's own ``finally`` never runs."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
