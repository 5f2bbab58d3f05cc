"""Conversions between relayrl's engine types and vLLM's, for the vLLM backend: the parameter specs a weight
update must carry, greedy requests, and the logprob entries of vLLM's outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from relayrl.common.weights import TensorSpec, parameter_specs
from relayrl.inference.engine import Alternatives, GenerationInput


def hf_parameter_specs(path: str, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of the Hugging Face model's unique parameters (what the trainer sends), from its
    config alone (meta device, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return parameter_specs(model)


def greedy(inp: GenerationInput) -> bool:
    return inp.top_k == 1 and inp.temperature == 1.0


def alternatives(entries: Mapping[int, Any] | None, k: int) -> Alternatives:
    """The k most likely tokens of one position of vLLM's logprobs (it adds the sampled or prompt token, ranked)."""
    if not k or not entries:
        return []
    ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank is not None and lp.rank <= k)
    return [(tid, float(lp)) for _, tid, lp in ranked]


def prompt_logprobs(
    inp: GenerationInput, entries: Sequence[Mapping[int, Any] | None]
) -> tuple[list[float | None], list[Alternatives]]:
    """The prompt tokens' logprobs and alternatives from vLLM's per-position dicts (the first is None)."""
    k = inp.prompt_logprobs or 0
    ids = inp.prompt_ids
    scored: list[float | None] = [float(d[t].logprob) if d else None for d, t in zip(entries[1:], ids[1:], strict=True)]
    return [None, *scored], [[]] + [alternatives(d, k) for d in entries[1:]]
