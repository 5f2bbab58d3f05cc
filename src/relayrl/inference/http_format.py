"""OpenAI response fragments built from engine outputs: logprob objects (completions' legacy shape and chat's),
usage and the oldest weight version of a response."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from relayrl.inference.engine import Alternatives, GenerationInput, SampleOutput

Pieces = Callable[[list[int]], list[str]]  # token ids -> their text, one piece per token


def _top_dict(pieces: Pieces, alternatives: Alternatives, sampled: tuple[int, float] | None) -> dict[str, float]:
    """A completion's ``top_logprobs`` entry: the alternatives, plus the sampled token when it is not among them."""
    pairs = list(alternatives)
    if sampled is not None and sampled[0] not in {i for i, _ in pairs}:
        pairs.append(sampled)
    texts = pieces([i for i, _ in pairs])
    out: dict[str, float] = {}
    for text, (_, lp) in zip(texts, pairs, strict=True):
        out.setdefault(text, lp)  # two ids with one text: the likelier one (listed first) wins
    return out


def completion_logprobs(
    pieces: Pieces, s: SampleOutput, n: int, prompt_ids: Sequence[int] | None = None, text_start: int = 0
) -> dict[str, Any]:
    """The legacy ``logprobs`` object of a completion choice: tokens, their logprobs, the ``n`` alternatives
    of each (None with n=0) and text offsets; with ``prompt_ids`` (echo) the prompt's tokens come first."""
    tokens: list[int] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if prompt_ids is not None:
        tokens += list(prompt_ids)
        lps += list(s.prompt_logprobs) or [None] * len(prompt_ids)
        prompt_top = s.prompt_top_logprobs or [[] for _ in prompt_ids]
        tops.append(None)
        for alt, t, lp in zip(prompt_top[1:], tokens[1:], lps[1:], strict=True):
            tops.append(_top_dict(pieces, alt, (t, lp)) if n and lp is not None else None)
    tokens += s.token_ids
    lps += s.logprobs
    alternatives = s.top_logprobs or [[] for _ in s.token_ids]
    tops += [
        _top_dict(pieces, alt, (t, lp)) if n else None
        for alt, t, lp in zip(alternatives, s.token_ids, s.logprobs, strict=True)
    ]
    texts = pieces(tokens)
    offsets, at = [], text_start
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops if n else None, "text_offset": offsets}


def _entry(text: str, lp: float) -> dict[str, Any]:
    return {"token": text, "logprob": lp, "bytes": list(text.encode())}


def chat_logprobs(pieces: Pieces, s: SampleOutput, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """Chat's ``logprobs`` object for tokens [start, end) of a sample: each token with its alternatives."""
    ids, lps = s.token_ids[start:end], s.logprobs[start:end]
    alternatives = (s.top_logprobs or [[] for _ in s.token_ids])[start:end]
    texts = pieces(ids)
    content = []
    for text, lp, alt in zip(texts, lps, alternatives, strict=True):
        entry = _entry(text, lp)
        entry["top_logprobs"] = [_entry(t, a) for t, (_, a) in zip(pieces([i for i, _ in alt]), alt, strict=True)]
        content.append(entry)
    return {"content": content}


def without_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` as OpenAI returns it: up to the first stop string, without it. (The engines keep the stop string,
    whose tokens the sample's token ids, logprobs and usage still count, as vLLM's do.) The stop that ends first
    wins, the longest of those ending together; a text still growing (streaming) is cut the same way."""
    hits = [(text.find(s) + len(s), len(s)) for s in stops if s and s in text]
    if not hits:
        return text
    end, length = min(hits, key=lambda h: (h[0], -h[1]))
    return text[: end - length]


def usage(inputs: list[GenerationInput], results: list[list[SampleOutput]]) -> dict[str, int]:
    prompt = sum(len(i.prompt_ids) for i in inputs)
    completion = sum(len(s.token_ids) for r in results for s in r)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def oldest(results: list[list[SampleOutput]], current: int) -> int:
    """The oldest weight version among a response's tokens (the served version when it has none)."""
    versions = [min(s.weight_versions) for r in results for s in r if s.weight_versions]
    return min(versions) if versions else current
