"""What a generation request may ask for: the one validator of gRPC (Generate, GenerateBatch, GenerateStream,
ScoreTokens) and the OpenAI-compatible REST API (completions, chat, streamed or not).

Each front end turns its request into a :class:`~relayrl.inference.engine.GenerationInput` (mapping its own
conventions first: gRPC's 0 means "unset", REST's ``temperature: 0`` means greedy) and hands it to
:func:`check_request`; a call of several samples is first weighed by :func:`check_samples`. A refusal is a
:class:`SamplingError` naming the field, the value and the rule (INVALID_ARGUMENT / HTTP 400) or a
:class:`LimitExceeded` over one of the service's size limits (RESOURCE_EXHAUSTED / HTTP 413 or 429). Every float is
finite: NaN and +/-Infinity reach here from protobuf floats and from JSON (Python's json reads ``Infinity`` and
``NaN``), and are refused like any other value out of range.
"""

from __future__ import annotations

import math
from typing import Any

from relayrl.config.inference import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    InferenceConfig,
)
from relayrl.inference.engine import GenerationInput

MAX_ALTERNATIVES = 20  # top_logprobs / logprobs=N (and the prompt's alternatives with echo): OpenAI's own cap on chat
MAX_STOP_TOKEN_IDS = 64  # the engine holds samples x this many stop ids per decode step


class LimitExceeded(ValueError):
    """A request over one of the service's size or load limits: RESOURCE_EXHAUSTED over gRPC, ``http_status`` (413
    too large, 429 too many waiting) over REST. Refused before any work is done."""

    def __init__(self, message: str, http_status: int = 413) -> None:
        super().__init__(message)
        self.http_status = http_status


class SamplingError(ValueError):
    """A request field outside its rule (INVALID_ARGUMENT / HTTP 400): ``field`` is the engine input's name of it
    (the gRPC SamplingParams name); :meth:`message` words it under another API's name."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        self.field, self.value, self.rule = field, value, rule
        super().__init__(self.message(field))

    def message(self, name: str) -> str:
        return f"{name}={self.value!r}: {self.rule}"


def _finite_in(name: str, value: float, low: float, high: float, rule: str) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise SamplingError(name, value, rule)


def check_samples(n_values: list[int], cfg: InferenceConfig, what: str) -> None:
    """One call's samples against ``max_samples_per_request``: each n >= 1 (SamplingError), their sum within the
    limit (LimitExceeded), before anything of the call is tokenised or queued. ``what`` names the call's parts."""
    for n in n_values:
        if n < 1:
            raise SamplingError("n", n, "must be >= 1")
    total = sum(n_values)
    if total > cfg.max_samples_per_request:
        raise LimitExceeded(
            f"{what} ask for {total} samples, over max_samples_per_request={cfg.max_samples_per_request}"
        )


def check_request(inp: GenerationInput, cfg: InferenceConfig, vocab: int, context: int) -> GenerationInput:
    """``inp`` when the engine may see it; else SamplingError (→ INVALID_ARGUMENT / HTTP 400) or LimitExceeded
    (→ RESOURCE_EXHAUSTED / HTTP 413). ``vocab`` and ``context``: the served model's."""
    ids = inp.prompt_ids
    if not ids:
        raise ValueError("the prompt has no tokens")
    if len(ids) > cfg.max_prompt_tokens:
        raise LimitExceeded(f"prompt has {len(ids)} tokens, limit is max_prompt_tokens={cfg.max_prompt_tokens}")
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if inp.n < 1:
        raise SamplingError("n", inp.n, "must be >= 1")
    if inp.n > cfg.max_samples_per_request:
        raise LimitExceeded(f"n={inp.n} is over max_samples_per_request={cfg.max_samples_per_request}")
    _check_lengths(inp, cfg, context)
    _check_distribution(inp, vocab)
    _check_stops(inp, vocab)
    if inp.seed is not None and not -(2**63) <= inp.seed < 2**64:  # what a torch generator takes
        raise SamplingError("seed", inp.seed, "must be in [-2**63, 2**64)")
    return inp


def _check_lengths(inp: GenerationInput, cfg: InferenceConfig, context: int) -> None:
    if not 1 <= inp.max_new_tokens <= cfg.max_new_tokens_limit:
        raise SamplingError(
            "max_new_tokens", inp.max_new_tokens, f"must be in [1, {cfg.max_new_tokens_limit}] (max_new_tokens_limit)"
        )
    if len(inp.prompt_ids) + inp.max_new_tokens > context:
        raise SamplingError(
            "max_new_tokens",
            inp.max_new_tokens,
            f"the prompt ({len(inp.prompt_ids)} tokens) + max_new_tokens exceeds the model's context length {context}",
        )


def _check_distribution(inp: GenerationInput, vocab: int) -> None:
    _finite_in(
        "temperature",
        inp.temperature,
        MIN_TEMPERATURE,
        MAX_TEMPERATURE,
        f"must be a finite number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] (or 0: gRPC's default 1, "
        "REST's greedy)",
    )
    _finite_in("top_p", inp.top_p, math.ulp(0.0), 1.0, "must be a finite number in (0, 1]")
    if not 0 <= inp.top_k <= vocab:
        raise SamplingError("top_k", inp.top_k, f"must be in [0, {vocab}] (0: off; at most the vocabulary)")
    if not 0 <= inp.top_logprobs <= MAX_ALTERNATIVES:
        raise SamplingError("top_logprobs", inp.top_logprobs, f"must be in [0, {MAX_ALTERNATIVES}]")
    if inp.prompt_logprobs is not None and not 0 <= inp.prompt_logprobs <= MAX_ALTERNATIVES:
        raise SamplingError("prompt_logprobs", inp.prompt_logprobs, f"must be in [0, {MAX_ALTERNATIVES}]")


def _check_stops(inp: GenerationInput, vocab: int) -> None:
    if len(inp.stop) > MAX_STOP_STRINGS:
        raise SamplingError("stop", f"{len(inp.stop)} strings", f"at most {MAX_STOP_STRINGS} stop strings")
    for stop in inp.stop:
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise SamplingError(
                "stop", stop[:32], f"stop strings must not be empty, at most {MAX_STOP_CHARS} characters each"
            )
    if len(inp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise SamplingError("stop_token_ids", f"{len(inp.stop_token_ids)} ids", f"at most {MAX_STOP_TOKEN_IDS}")
    for t in inp.stop_token_ids:
        if not 0 <= t < vocab:
            raise SamplingError("stop_token_ids", t, f"stop_token_ids must be in [0, {vocab})")
