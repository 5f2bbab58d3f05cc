"""Weight-update verification by a probe batch.

After every weight swap the inference engine scores a fixed probe batch (token sequences chosen by the trainer)
and returns, for each sequence, the logprob of every token after the first under the full softmax at
temperature 1. The trainer scores the same batch with its own copy of the weights and refuses to go on when the
largest absolute difference exceeds the tolerance of the model's dtype. A mismatch means inference serves other
weights than the trainer's: a silently broken reload (e.g. a tied output layer left behind), a corrupted
transfer, or a numerics problem; every one of them would poison the importance ratios without an error.

Tolerances (max |Δ logprob|), for the same weights computed by two different kernels / batch layouts:
- float32: reduction order only, observed ≤ 1e-5 on the tiny models; 1e-3 leaves two orders of margin while
  a wrong layer moves logprobs by 0.1-2.
- float16: 10-bit mantissa (relative rounding 4.9e-4); logits of magnitude ~10 carry ~5e-3 of rounding per
  kernel, so 2e-2.
- bfloat16: 7-bit mantissa (relative rounding 3.9e-3), ~4e-2 per logit of magnitude 10, two kernels: 1e-1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

PROBE_TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}


class WeightVerificationError(Exception):
    """Inference serves weights whose probe logprobs disagree with the trainer's."""


def probe_sequences(
    vocab_size: int, num_sequences: int, length: int, seed: int, exclude: Sequence[int] = ()
) -> list[list[int]]:
    """A deterministic probe batch: random token ids over the whole vocabulary (special tokens excluded), so
    that every layer, including the input and output embeddings, takes part."""
    if num_sequences < 1 or length < 2:
        raise ValueError("a probe needs >= 1 sequence of >= 2 tokens")
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[i for i in exclude if 0 <= i < vocab_size]] = False
    ids = allowed.nonzero().squeeze(1)
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(ids), (num_sequences, length), generator=g)
    return ids[picks].tolist()  # type: ignore[no-any-return]


def check_probe(
    sequences: Sequence[Sequence[int]],
    vocab_size: int | None = None,
    max_length: int | None = None,
    max_tokens: int | None = None,
) -> None:
    """ValueError unless the probe is >= 1 sequence of >= 2 tokens, each id in [0, vocab_size), each sequence at
    most ``max_length`` tokens and all of them together at most ``max_tokens`` (limits checked when given)."""
    if not sequences or any(len(s) < 2 for s in sequences):
        raise ValueError("probe sequences must be non-empty and have >= 2 tokens each")
    if max_length is not None and any(len(s) > max_length for s in sequences):
        raise ValueError(f"a probe sequence is longer than the model's context ({max_length} tokens)")
    total = sum(len(s) for s in sequences)
    if max_tokens is not None and total > max_tokens:
        raise ValueError(f"the probe has {total} tokens, over the limit of {max_tokens}")
    if vocab_size is not None and any(not 0 <= t < vocab_size for s in sequences for t in s):
        raise ValueError(f"probe token ids must be in [0, {vocab_size})")


@torch.inference_mode()
def probe_logprobs(model: Any, sequences: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Logprobs (float32, flattened in sequence order) of tokens 1.. of each sequence given the ones before,
    by one right-padded forward pass of a Hugging Face causal LM."""
    check_probe(sequences)
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
    return logp[mask[:, 1:].bool()].cpu()


def timed_probe_logprobs(
    score: Callable[[Any, Sequence[Sequence[int]], torch.device], torch.Tensor],
    model: Any,
    sequences: Sequence[Sequence[int]],
    device: torch.device,
) -> tuple[list[float], float]:
    """``score`` (:func:`probe_logprobs`) as a list (empty for no probe) and the seconds it took."""
    t0 = time.perf_counter()
    result: list[float] = score(model, sequences, device).tolist() if sequences else []
    return result, time.perf_counter() - t0


def compare_probe(
    expected: torch.Tensor, served: Sequence[float], dtype: torch.dtype, version: int, tolerance: float | None = None
) -> float:
    """Largest |Δ logprob| between the trainer's and the server's probe; raises WeightVerificationError over the
    tolerance (the dtype's default unless given)."""
    got = torch.tensor(list(served), dtype=torch.float32)
    if got.shape != expected.shape:
        raise WeightVerificationError(
            f"version {version}: the server returned {got.numel()} probe logprobs, expected {expected.numel()}"
        )
    diff = float((got - expected).abs().max()) if got.numel() else 0.0
    tol = PROBE_TOLERANCE.get(dtype, 1e-1) if tolerance is None else tolerance
    if not diff <= tol:  # also catches NaN
        raise WeightVerificationError(
            f"inference serves weights that disagree with the trainer's at version {version}: max |Δ logprob| "
            f"over the probe batch = {diff:.3g} > tolerance {tol:g} for {str(dtype).removeprefix('torch.')}"
        )
    return diff
