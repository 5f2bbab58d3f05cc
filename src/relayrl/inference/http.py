"""The handlers of the inference service's OpenAI-compatible REST API: /v1/models, /v1/completions,
/v1/chat/completions (the app, with /healthz and /metrics: relayrl.inference.http_app). See docs/clients.md for
what each field does.

Beside the OpenAI fields, every choice carries ``weight_versions`` (the version that produced each token) and
every response ``weight_version`` (the oldest version among its tokens, i.e. how stale the response can be).
Logprobs are those of the tempered full softmax, before top-k/top-p truncation (see relayrl.inference.engine);
alternatives (``logprobs=N`` on completions, ``top_logprobs`` on chat) are the N most likely tokens of that same
distribution, and the sampled token is added to a completion's ``top_logprobs`` dict when it is not among them
(vLLM's convention). ``echo`` with logprobs scores the prompt the same way (the first prompt token: null).
``stream=true`` answers with server-sent events (:mod:`relayrl.inference.http_stream`); a client that goes
away cancels its request in the engine at once. Chat prompts and tools: :mod:`relayrl.inference.openai_tools`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH
from relayrl.inference.engine import GenerationInput, SampleOutput
from relayrl.inference.http_format import chat_logprobs, completion_logprobs, oldest, usage, without_stop
from relayrl.inference.openai_schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    _Sampling,
    refuse_unsupported,
)
from relayrl.inference.openai_tools import answer, chat_prompt, uses_tools
from relayrl.inference.sampling_limits import LimitExceeded, SamplingError, check_samples
from relayrl.inference.serving import InferenceService
from relayrl.inference.token_stream import Submitted, cancel

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "OpenAiApi", "finish_reason"]


def rest_name(req: _Sampling, field: str) -> str:
    """The REST request's name of a GenerationInput field (relayrl.inference.sampling_limits names those)."""
    if field == "max_new_tokens":
        chosen = isinstance(req, ChatRequest) and req.max_completion_tokens is not None
        return "max_completion_tokens" if chosen else "max_tokens"
    if field in ("top_logprobs", "prompt_logprobs"):
        return "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
    return field


def finish_reason(s: SampleOutput) -> str:
    return "length" if s.finish_reason == FINISH_REASON_LENGTH else "stop"


class OpenAiApi:
    """The handlers of the OpenAI-compatible routes over one :class:`InferenceService`."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    def generation_input(
        self, req: _Sampling, ids: list[int], max_tokens: int | None, top: int = 0, prompt_logprobs: int | None = None
    ) -> GenerationInput:
        """The engine's input for one prompt of a request; ApiError for a request the engine would refuse."""
        service = self.service
        if req.model not in (None, "", service.model_name):
            raise ApiError(
                f"model {req.model!r} is not served here (this server serves {service.model_name!r})", "model", 404
            )
        if (top or prompt_logprobs is not None) and not getattr(service.engine, "computes_alternatives", False):
            param = (
                "echo"
                if prompt_logprobs is not None
                else "logprobs"
                if isinstance(req, CompletionRequest)
                else "top_logprobs"
            )
            raise ApiError(
                f"{param}: this engine ({service.cfg.engine.value}) does not compute logprob "
                "alternatives or prompt logprobs",
                param,
            )
        inp = GenerationInput(
            prompt_ids=ids,
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_new_tokens=16 if max_tokens is None else max_tokens,
            stop=req.stops(),
            stop_token_ids=list(req.stop_token_ids),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            top_logprobs=top,
            prompt_logprobs=prompt_logprobs,
        )
        if req.temperature == 0:  # greedy, as OpenAI defines temperature 0
            inp.temperature, inp.top_k = 1.0, 1
        try:
            return service.check(inp)
        except SamplingError as exc:  # the rule, under this API's name of the field
            name = rest_name(req, exc.field)
            raise ApiError(exc.message(name), name) from exc
        except ValueError as exc:
            raise ApiError.refused(exc) from exc

    def check_logprob_cost(self, inputs: list[GenerationInput], top: int, param: str) -> None:
        """ApiError 413 for a request whose logprobs would cost more than the service allows, before it is queued:
        the engine's prompt x vocabulary matrix of an echoed prompt, and the values the response would hold."""
        cfg, vocab = self.service.cfg, self.service.engine.vocab_size
        entries = 0
        for inp in inputs:
            scored = len(inp.prompt_ids) if inp.prompt_logprobs is not None else 0
            mib = scored * vocab * 4 / 2**20
            if mib > cfg.max_prompt_logprob_mib:
                raise ApiError(
                    f"echo with logprobs scores a {scored}-token prompt against a {vocab}-token vocabulary "
                    f"({mib:.0f} MiB of float32 logprobs), over max_prompt_logprob_mib="
                    f"{cfg.max_prompt_logprob_mib}",
                    "echo",
                    413,
                )
            entries += inp.n * (scored + inp.max_new_tokens) * (1 + top)
        if entries > cfg.max_logprob_entries:
            raise ApiError(
                f"the request asks for up to {entries} logprob values ((echoed prompt tokens + max tokens) "
                f"x (1 + {top} alternatives) x samples), over max_logprob_entries={cfg.max_logprob_entries}",
                param,
                413,
            )

    def submit(self, inputs: list[GenerationInput]) -> list[Submitted]:
        """Submit every input, all or none: a refused one cancels those already queued."""
        submitted: list[Submitted] = []
        try:
            for inp in inputs:
                submitted.append(self.service.submit(inp))
        except ValueError as exc:
            cancel(submitted)
            raise ApiError.refused(exc) from exc
        return submitted

    async def run(self, inputs: list[GenerationInput]) -> list[list[SampleOutput]]:
        """Submit every input, then wait for all (cancelled in the engine when the caller is cancelled)."""
        submitted = self.submit(inputs)
        try:
            return list(await asyncio.gather(*(self.service.result(s, "openai") for s in submitted)))
        finally:
            cancel(submitted)  # no-op for finished ones; frees the rows of a request whose client went away

    def pieces(self, tokens: list[int]) -> list[str]:
        return [self.service.tokenizer.decode([t]) for t in tokens]

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
        return {
            "object": "list",
            "data": [
                {
                    "id": self.service.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "relayrl",
                    "weight_version": self.service.engine.version,
                }
            ],
        }

    async def completion_inputs(self, req: CompletionRequest) -> list[GenerationInput]:
        refuse_unsupported(req)
        if req.echo and req.stream:
            raise ApiError("echo with stream=true is not supported", "echo")
        count = (
            len(req.prompt) if isinstance(req.prompt, list) and not all(isinstance(p, int) for p in req.prompt) else 1
        )  # checked before any prompt is tokenised
        try:
            check_samples([req.n] * count, self.service.cfg, f"{count} prompts x n={req.n}")
        except SamplingError as exc:
            raise ApiError(exc.message("n"), "n") from exc
        except LimitExceeded as exc:
            raise ApiError(str(exc), "prompt", 413) from exc
        top = req.logprobs or 0
        prompt_lp = top if req.echo and req.logprobs is not None else None
        inputs = [
            self.generation_input(req, ids, req.max_tokens, top, prompt_lp) for ids in await self.prompts(req.prompt)
        ]
        if req.logprobs is not None:
            self.check_logprob_cost(inputs, top, "logprobs")
        return inputs

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        inputs = await self.completion_inputs(req)
        results = await self.run(inputs)
        choices: list[dict[str, Any]] = []
        for inp, samples in zip(inputs, results, strict=True):
            prompt_text = self.service.tokenizer.decode(inp.prompt_ids) if req.echo else ""
            for s in samples:
                text = prompt_text + without_stop(s.text, inp.stop)
                choice: dict[str, Any] = {
                    "index": len(choices),
                    "text": text,
                    "finish_reason": finish_reason(s),
                    "logprobs": None,
                    "weight_versions": s.weight_versions,
                }
                if req.logprobs is not None:
                    choice["logprobs"] = completion_logprobs(
                        self.pieces, s, req.logprobs, inp.prompt_ids if req.echo else None
                    )
                choices.append(choice)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.service.model_name,
            "choices": choices,
            "usage": usage(inputs, results),
            "weight_version": oldest(results, self.service.engine.version),
        }

    async def chat_input(self, req: ChatRequest) -> GenerationInput:
        refuse_unsupported(req)
        ids = await _tokens(self.service, chat_prompt(self.service.tokenizer, req))
        top = (req.top_logprobs or 0) if req.logprobs else 0
        # OpenAI's chat default is "until the context is full": here, up to the server's max_new_tokens_limit
        room = min(self.service.cfg.max_new_tokens_limit, self.service.engine.context_length - len(ids))
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        inp = self.generation_input(req, ids, max(1, room) if asked is None else asked, top)
        if req.logprobs:
            self.check_logprob_cost([inp], top, "top_logprobs" if top else "logprobs")
        return inp

    async def chat(self, req: ChatRequest) -> dict[str, Any]:
        inp = await self.chat_input(req)
        [samples] = await self.run([inp])
        choices: list[dict[str, Any]] = []
        for i, s in enumerate(samples):
            message, calls = answer(without_stop(s.text, inp.stop), uses_tools(req))
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": "tool_calls" if calls else finish_reason(s),
                    "logprobs": chat_logprobs(self.pieces, s) if req.logprobs else None,
                    "weight_versions": s.weight_versions,
                }
            )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.service.model_name,
            "choices": choices,
            "usage": usage([inp], [samples]),
            "weight_version": oldest([samples], self.service.engine.version),
        }


async def _tokens(service: InferenceService, text: str) -> list[int]:
    try:
        return await service.tokenize_cached(text)
    except ValueError as exc:
        raise ApiError.refused(exc, "prompt") from exc
