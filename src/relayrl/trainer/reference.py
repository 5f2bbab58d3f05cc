"""The frozen reference model of the KL term (``trainer.loss.kl_coef > 0``): the trainer's own copy of the
initial weights, loaded from ``model.path`` (so a resumed run keeps the same reference), never trained.

What is missing: the reference's logprobs from an inference endpoint serving the reference weights (it costs a
second model in the trainer's memory here), and a reference that follows the policy periodically.
"""

from __future__ import annotations

from typing import Any

import torch

from relayrl.trainer.batching import PackedBatch, model_logprobs

__all__ = ["Reference", "model_logprobs"]


class Reference:
    """A frozen model giving log pi_ref for the tokens of a micro-batch."""

    def __init__(self, model: Any) -> None:
        self.model = model
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, mb: PackedBatch, chunk: int = 0) -> torch.Tensor:
        return model_logprobs(self.model, mb, chunk)
