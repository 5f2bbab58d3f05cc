"""The frozen reference model of the KL term (``trainer.loss.kl_coef > 0``): the trainer's own copy of the
initial weights, loaded from ``model.path`` (so a resumed run keeps the same reference), never trained.

What is missing: the reference's logprobs from an inference endpoint serving the reference weights (it costs a
second model in the trainer's memory here), and a reference that follows the policy periodically.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from relayrl.trainer.batching import PackedBatch
from relayrl.trainer.loss import token_logprobs


def model_logprobs(model: Any, mb: PackedBatch) -> torch.Tensor:
    """log pi(target) at every position of ``mb`` (``[B, L]``): padded rows with their attention mask, packed
    rows with no mask and their position ids (transformers separates the sequences by them, but only without a
    KV cache: ``use_cache=False``, which a training forward never needs)."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                   use_cache=False).logits
    return token_logprobs(logits, mb.targets, mb.temperature)


class Reference:
    """A frozen model giving log pi_ref for the tokens of a micro-batch."""

    def __init__(self, model: Any) -> None:
        self.model = model
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, mb: PackedBatch) -> torch.Tensor:
        return model_logprobs(self.model, mb)

    @torch.no_grad()
    def sequence_sums(self, mb: PackedBatch, per_token: torch.Tensor) -> torch.Tensor:
        """Sums of ``per_token * mask`` per sequence of ``mb`` (``[sequences]``)."""
        out = torch.zeros(mb.sequences(), dtype=per_token.dtype, device=per_token.device)
        return out.index_add_(0, mb.sequence_index().reshape(-1), (per_token * mb.mask).reshape(-1))


def sequence_lengths(episodes: Sequence[Any]) -> torch.Tensor:
    """Completion lengths of ``episodes`` (for the overlong penalty)."""
    return torch.tensor([len(e.completion_token_ids) for e in episodes], dtype=torch.float64)
