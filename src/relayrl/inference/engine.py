"""What the inference service needs from a generation engine, and the sampling both engines share.

Logprob convention: the logprob of a sampled token is taken from the full softmax of logits / temperature,
*before* top-k/top-p truncation. The trainer recomputes logprobs the same way (log_softmax at the episode's
temperature), so importance ratios compare like with like. (vLLM's default is the same: raw logprobs of the
tempered distribution.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from relayrl.common.weights import TensorSpec


@dataclass
class GenerationInput:
    prompt_ids: list[int]
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0  # alternatives per generated token (the k most likely under the tempered softmax)
    prompt_logprobs: int | None = None  # None: none; k >= 0: the prompt tokens' logprobs and k alternatives each
    on_token: Callable[[TokenEvent], None] | None = None  # streaming: called on the engine thread per token


Alternatives = list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one sample, as soon as it is sampled (before stop strings are applied)."""

    index: int  # sample index within the request
    token_id: int
    logprob: float
    version: int
    top: Alternatives


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: int
    text: str
    top_logprobs: list[Alternatives] = field(default_factory=list)  # per token, when asked
    prompt_logprobs: list[float | None] = field(default_factory=list)  # per prompt token (first: None)
    prompt_top_logprobs: list[Alternatives] = field(default_factory=list)


@dataclass(frozen=True)
class EngineStats:
    running_sequences: int
    running_requests: int
    queued_requests: int
    decode_steps: int
    cancelled_sequences: int = 0  # rows freed because their request was cancelled (client gone)


class Engine(Protocol):
    """A generation engine: requests in, samples out; weights swapped between decode steps and verified."""

    @property
    def version(self) -> int: ...

    @property
    def specs(self) -> dict[str, TensorSpec]:
        """Names, dtypes and shapes a weight update must carry."""
        ...

    @property
    def context_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def submit(self, inp: GenerationInput) -> Future[list[SampleOutput]]:
        """Queue a request; the future resolves to its ``n`` samples. Cancelling it frees its sequences."""
        ...

    def update_weights(
        self, tensors: Mapping[str, torch.Tensor], version: int, probe: Sequence[Sequence[int]] = ()
    ) -> list[float]:
        """Swap in new weights atomically between decode steps (blocking), then return the logprobs of the
        probe sequences under them (see relayrl.common.probe)."""
        ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...


def generate(
    engine: Engine, batch: Sequence[GenerationInput], timeout: float | None = None
) -> list[list[SampleOutput]]:
    """Blocking convenience: submit every input and wait for all of them."""
    futures = [engine.submit(inp) for inp in batch]
    return [f.result(timeout) for f in futures]


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (token ids [B], their logprobs [B] under the full tempered softmax).

    logits [B, V] (any float dtype), temperature [B] (> 0), top_k [B] (0 = off), top_p [B] (1 = off).
    """
    tokens, lp, _ = sample_with_alternatives(logits, temperature, top_k, top_p, generator, 0)
    return tokens, lp


def top_alternatives(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely entries along the last dim of ``logprobs``: (logprobs [..., k], token ids [..., k])."""
    k = min(k, logprobs.shape[-1])
    values, ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[..., :0], logprobs[..., :0].long())
    return values, ids


def sample_with_alternatives(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None,
    alternatives: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`sample_tokens` plus the ``alternatives`` most likely tokens of every row under the same tempered
    full softmax: (tokens [B], logprobs [B], (top logprobs [B, k], top ids [B, k]))."""
    assert logits.dim() == 2 and temperature.shape == logits.shape[:1], (logits.shape, temperature.shape)
    scaled = logits.float() / temperature.unsqueeze(1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    vocab = scaled.shape[1]
    truncate = bool(((top_k > 0) & (top_k < vocab)).any() | (top_p < 1.0).any())
    if truncate:
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
        probs_sorted = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        keep = (ranks < k) & (mass_before < top_p.unsqueeze(1))
        keep[:, 0] = True  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
        choice = torch.multinomial(torch.softmax(sorted_logits, dim=-1), 1, generator=generator)
        tokens = sorted_idx.gather(1, choice).squeeze(1)
    else:
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1), top_alternatives(logprobs, alternatives)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text
