"""Server-sent-event streaming of /v1/completions and /v1/chat/completions (``stream=true``).

The engine hands every sampled token to the request's ``on_token`` on its own thread; the tokens reach the
response's event loop through a queue and leave as ``data: {chunk}`` events, each with the text the new tokens add
(a trailing incomplete UTF-8 character waits for the next token), their logprobs when asked and their
``weight_versions``. The stop string that ends a choice is not sent (OpenAI's convention): mid-stream, the last
characters that could begin one wait for the next token. When a choice finishes, a last chunk carries its remaining
text and ``finish_reason`` (the engine's final text, cut before its stop string, is authoritative); with
``stream_options.include_usage`` a last chunk with empty ``choices`` carries ``usage`` and the response's oldest
``weight_version``; then ``data: [DONE]``. A chat request with tools streams its answer in one chunk when it
finishes (the tool calls must be parsed from the whole text). If the client goes away, the generator is closed and
its requests are cancelled in the engine, which frees their rows before its next decode step (the engine-to-loop
plumbing is relayrl.inference.token_stream's, shared with gRPC's GenerateStream).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from relayrl.common.openai_sse import DONE, sse
from relayrl.inference.engine import Alternatives, GenerationInput, SampleOutput
from relayrl.inference.http import OpenAiApi, finish_reason
from relayrl.inference.http_format import chat_logprobs, completion_logprobs, oldest, usage, without_stop
from relayrl.inference.openai_schema import ApiError, ChatRequest, CompletionRequest, error_body
from relayrl.inference.openai_tools import answer, uses_tools
from relayrl.inference.token_stream import cancel, events, feed

log = logging.getLogger(__name__)


@dataclass
class _Choice:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tops: list[Alternatives] = field(default_factory=list)
    sent_text: str = ""
    sent_tokens: int = 0

    def pending(self) -> SampleOutput:
        """The tokens not yet sent, as a (partial) sample."""
        k = self.sent_tokens
        return SampleOutput(self.tokens[k:], self.logprobs[k:], self.versions[k:], 0, "", self.tops[k:])

    def take(self, sample: SampleOutput) -> None:
        """Adopt the finished sample's tokens (authoritative: also those the stream never saw)."""
        self.tokens, self.logprobs, self.versions = sample.token_ids, sample.logprobs, sample.weight_versions
        self.tops = sample.top_logprobs or [[] for _ in sample.token_ids]


class _Stream:
    """The chunks of one streamed response: ``delta`` turns new tokens into a chunk's choice."""

    def __init__(self, api: OpenAiApi, inputs: list[GenerationInput], n: int, chat: bool) -> None:
        self.api, self.inputs, self.n, self.chat = api, inputs, n, chat
        self.queue = feed(inputs)  # before submitting: a refusal is still an HTTP error
        self.submitted = api.submit(inputs)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(len(inputs) * n)]
        self.stops = inputs[0].stop if inputs else []
        # mid-stream, the last (longest stop - 1) characters wait: they may begin a stop string, which is not sent
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.api.service.model_name,
                "choices": choices,
                **extra,
            }
        )

    def advance(self, c: _Choice, final_text: str | None = None) -> str:
        """The text not yet sent: up to the engine's final text, or (mid-stream) what the tokens decode to."""
        if final_text is None:
            text = self.api.service.tokenizer.decode(c.tokens, skip_special_tokens=True).rstrip("\ufffd")
            if self.stops:
                text = without_stop(text, self.stops)
                text = text[: max(len(c.sent_text), len(text) - self.hold)]
        else:
            text = final_text
        if not text.startswith(c.sent_text):
            log.warning("streamed text diverged from the final text; sending the rest of the final text only")
            return text[len(c.sent_text) :] if final_text is not None else ""
        return text[len(c.sent_text) :]

    def piece(
        self,
        index: int,
        text: str,
        c: _Choice,
        logprobs: int | None,
        finish: str | None = None,
        extra_delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One choice of a chunk: the new text, the pending tokens' logprobs and versions; marks them sent."""
        pending = c.pending()
        lp: dict[str, Any] | None = None
        if logprobs is not None:
            lp = (
                chat_logprobs(self.api.pieces, pending)
                if self.chat
                else completion_logprobs(self.api.pieces, pending, logprobs, text_start=len(c.sent_text))
            )
        c.sent_text += text
        c.sent_tokens = len(c.tokens)
        out: dict[str, Any] = {
            "index": index,
            "logprobs": lp,
            "finish_reason": finish,
            "weight_versions": pending.weight_versions,
        }
        if self.chat:
            out["delta"] = {"content": text, **(extra_delta or {})} if text or extra_delta else {}
        else:
            out["text"] = text
        return out


async def _run(
    stream: _Stream, logprobs: int | None, include_usage: bool, buffer: bool, with_tools: bool
) -> AsyncIterator[str]:
    n, api = stream.n, stream.api
    results: list[list[SampleOutput]] = [[] for _ in stream.inputs]
    try:
        for i in range(len(stream.choices) if stream.chat else 0):  # one choice per chunk, as OpenAI sends them
            yield stream.chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
        async for kind, p, item in events(api.service, stream.queue, stream.submitted, "openai"):
            if kind == "token":
                index = p * n + item.index
                c = stream.choices[index]
                c.tokens.append(item.token_id)
                c.logprobs.append(item.logprob)
                c.versions.append(item.version)
                c.tops.append(item.top)
                text = "" if buffer else stream.advance(c)
                if text:
                    yield stream.chunk([stream.piece(index, text, c, logprobs)])
                continue
            results[p] = item
            for j, s in enumerate(item):
                index = p * n + j
                c = stream.choices[index]
                c.take(s)
                final, extra, reason = without_stop(s.text, stream.stops), None, finish_reason(s)
                if with_tools:
                    message, calls = answer(final, True)
                    final = message["content"] or ""
                    if calls:
                        extra, reason = {"tool_calls": [t.openai(k) for k, t in enumerate(calls)]}, "tool_calls"
                text = stream.advance(c, final)
                yield stream.chunk(
                    [stream.piece(index, text, c, logprobs, reason, extra)],
                    weight_version=oldest([[s]], api.service.engine.version),
                )
    except ApiError as exc:
        yield sse(error_body(exc.status, str(exc), exc.param))
        return
    except Exception as exc:  # the engine failed the request mid-stream: say so in the stream, then stop
        log.exception("streamed request failed")
        yield sse(error_body(500, f"generation failed: {type(exc).__name__}"))
        return
    finally:
        cancel(stream.submitted)  # also when the client went away before the first event
    if include_usage:
        yield stream.chunk(
            [], usage=usage(stream.inputs, results), weight_version=oldest(results, api.service.engine.version)
        )
    yield DONE


def stream_completions(api: OpenAiApi, req: CompletionRequest, inputs: list[GenerationInput]) -> AsyncIterator[str]:
    return _run(_Stream(api, inputs, req.n, chat=False), req.logprobs, req.include_usage, False, False)


def stream_chat(api: OpenAiApi, req: ChatRequest, inp: GenerationInput) -> AsyncIterator[str]:
    tools = uses_tools(req)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _run(_Stream(api, [inp], req.n, chat=True), logprobs, req.include_usage, tools, tools)
