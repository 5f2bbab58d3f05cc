"""The inference service's logic, shared by its gRPC and REST front ends: request checks, generation, weight
updates, counters."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from relayrl.common.model import chat_token_ids
from relayrl.common.service import StatusHeader
from relayrl.common.weights import StaleVersionError, WeightUpdateError
from relayrl.config.inference import InferenceConfig
from relayrl.inference.engine import Engine, GenerationInput, SampleOutput
from relayrl.inference.metrics import InferenceMetrics
from relayrl.inference.sampling_limits import LimitExceeded, SamplingError, check_request

__all__ = ["InferenceService", "LimitExceeded", "SamplingError", "WeightSwapError"]

log = logging.getLogger(__name__)

# Prompt texts whose token ids are remembered (RL asks for the same prompts again and again: a dataset's rows, a
# group's retries), and the longest text remembered: a repeated prompt skips the tokenizer and the thread hop.
TOKEN_CACHE_SIZE = 4096
TOKEN_CACHE_MAX_CHARS = 2048


class WeightSwapError(Exception):
    """A validated weight update whose swap (or probe scoring) failed in the engine; the engine restored the old
    weights, and the served version never moved (FAILED_PRECONDITION over gRPC)."""


class InferenceService:
    def __init__(
        self,
        cfg: InferenceConfig,
        engine: Engine,
        tokenizer: Any,
        model_path: str,
        weights_dir: Path | None = None,
        weights_token: str = "",
    ) -> None:
        self.cfg = cfg
        self.weights_token = weights_token  # UpdateWeights needs it (empty: every update is refused)
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.model_name = cfg.model_name or Path(model_path).name
        self.weights_dir = weights_dir
        self.header = StatusHeader("inference")
        self.metrics = InferenceMetrics(engine.stats, lambda: engine.version)
        self._update_lock = asyncio.Lock()  # one swap at a time (receiving and assembling happen outside it)
        self.weights_target = ""  # where UpdateWeights is served (set when the weights server is bound)
        self.weight_streams = 0  # UpdateWeights calls in progress (receiving, assembling or swapping)
        self.requests_served = 0
        self.tokens_generated = 0
        self.weight_updates = 0
        self._token_cache: dict[str, tuple[int, ...]] = {}  # read and written on the event loop only

    async def tokenize_cached(self, text: str) -> list[int]:
        """:meth:`tokenize` off the event loop (CPU work), or the ids remembered for ``text`` (the tokenizer never
        changes while the service runs; the oldest entry goes first when the cache is full)."""
        ids = self._token_cache.get(text)
        if ids is not None:
            return list(ids)
        out = await asyncio.to_thread(self.tokenize, text)
        if len(text) <= TOKEN_CACHE_MAX_CHARS:
            if len(self._token_cache) >= TOKEN_CACHE_SIZE:
                del self._token_cache[next(iter(self._token_cache))]
            self._token_cache[text] = tuple(out)
        return out

    def tokenize(self, text: str) -> list[int]:
        if not text:
            raise ValueError("the prompt is empty")
        self.check_prompt_chars(len(text))
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids of a conversation, rendered once with the model's chat template (see chat_token_ids);
        ValueError for no messages, an empty role, no template; LimitExceeded over max_prompt_chars in all."""
        if not messages:
            raise ValueError("prompt_messages has no messages")
        if any(not m["role"] for m in messages):
            raise ValueError("every message needs a role")
        self.check_prompt_chars(sum(len(m["role"]) + len(m["content"]) for m in messages))
        return chat_token_ids(self.tokenizer, messages)

    def check_prompt_chars(self, chars: int) -> None:
        """LimitExceeded for a prompt text longer than max_prompt_chars: checked before tokenising it."""
        if chars > self.cfg.max_prompt_chars:
            raise LimitExceeded(f"prompt has {chars} characters, limit is max_prompt_chars={self.cfg.max_prompt_chars}")

    def check(self, inp: GenerationInput) -> GenerationInput:
        """``inp`` when the engine may see it: relayrl.inference.sampling_limits' rules against this service's limits
        and the served model's vocabulary and context. SamplingError / ValueError (→ INVALID_ARGUMENT / HTTP 400),
        LimitExceeded (→ RESOURCE_EXHAUSTED / HTTP 413)."""
        return check_request(inp, self.cfg, self.engine.vocab_size, self.engine.context_length)

    def submit(self, inp: GenerationInput) -> tuple[Future[list[SampleOutput]], float]:
        """Hand a checked request to the engine; ValueError when the engine refuses it (→ INVALID_ARGUMENT / HTTP
        400) before anything runs. Returns the future and the submission time."""
        queued = self.engine.stats().queued_requests
        if queued >= self.cfg.max_queued_requests:
            self.metrics.request_errors.labels("engine", "RESOURCE_EXHAUSTED").inc()
            raise LimitExceeded(
                f"{queued} requests are waiting for the engine (max_queued_requests="
                f"{self.cfg.max_queued_requests}); retry later",
                http_status=429,
            )
        return self.engine.submit(inp), time.perf_counter()

    async def result(self, submitted: tuple[Future[list[SampleOutput]], float], api: str) -> list[SampleOutput]:
        """Wait for a submitted request (cancelling the caller cancels it in the engine) and count it."""
        future, t0 = submitted
        samples = await asyncio.wrap_future(future)
        self.requests_served += 1
        n_tokens = sum(len(s.token_ids) for s in samples)
        self.tokens_generated += n_tokens
        self.metrics.requests.labels(api).inc()
        self.metrics.tokens.inc(n_tokens)
        self.metrics.latency.labels(api).observe(time.perf_counter() - t0)
        return samples

    async def apply_update(
        self, tensors: Mapping[str, torch.Tensor], version: int, probe: Sequence[Sequence[int]]
    ) -> list[float]:
        """Under the update lock: re-check the version (another update may have landed while this one was
        assembled), then swap (on the engine thread, between decode steps) and score the probe. Raises
        StaleVersionError / WeightUpdateError for a refused update, WeightSwapError when the engine failed (it
        restored the old weights); the version moves only after a successful swap and probe."""
        async with self._update_lock:
            if version <= self.engine.version:
                raise StaleVersionError(f"version {version} is not newer than the served version {self.engine.version}")
            try:
                return await asyncio.to_thread(self.engine.update_weights, tensors, version, probe)
            except WeightUpdateError:
                raise
            except Exception as exc:
                log.exception(
                    "weight swap to version %d failed; version %d keeps serving", version, self.engine.version
                )
                raise WeightSwapError(
                    f"the swap to version {version} failed ({type(exc).__name__}); version "
                    f"{self.engine.version} keeps serving"
                ) from exc

    @property
    def update_lock(self) -> asyncio.Lock:
        return self._update_lock
