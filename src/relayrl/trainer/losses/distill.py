"""On-policy distillation's per-token baseline (``trainer.loss.distill_baseline``).

The reverse-KL sample of a token, log pi_behav - log pi_teacher, has a large common part early in distillation
(about the KL itself: ~4.5 nats for a random student on the example's task) and a small informative part (which
token the teacher prefers). Entering the advantage raw, the common part multiplies grad log pi of every sampled
token: zero in expectation, but noise that swamps the signal. ``group`` subtracts the mean sample of the same
group's tokens at the same completion position (GRPO's group mean applied per token), computed on the host
before the batch is split into micro-batches, so any split gives the same baselines. Like GRPO's, it gives a
group whose members sampled alike no signal: a student that collapsed on a wrong token gets no push off it
(measured in docs/algorithms.md), which is why it is not the default.
"""

from __future__ import annotations

import torch

from relayrl.config.loss import DistillBaseline


def distill_baselines(
    kind: DistillBaseline, samples: torch.Tensor, group: torch.Tensor, position: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per token (flat ``[T]`` columns): the baseline of its reverse-KL sample. ``samples`` is log pi_behav - log
    pi_teacher; ``group`` the token's group, ``position`` its completion position; ``mask`` 0 for a token out of
    the loss (it neither enters a mean nor needs a baseline: 0). ``group``: the mean of the samples of the trained
    tokens at the same position of the group's episodes (the token's own included, as GRPO's mean; a lone token's
    baseline is itself), summed in float64; ``none``: zeros."""
    if kind is DistillBaseline.NONE or samples.numel() == 0:
        return torch.zeros_like(samples)
    keep = (mask > 0).to(torch.float64)
    key = group * (int(position.max()) + 1) + position.clamp(min=0)
    _, inverse = torch.unique(key, return_inverse=True)
    size = int(inverse.max()) + 1
    sums = torch.zeros(size, dtype=torch.float64).index_add_(0, inverse, samples.to(torch.float64) * keep)
    counts = torch.zeros(size, dtype=torch.float64).index_add_(0, inverse, keep)
    return torch.where(keep > 0, sums[inverse] / counts[inverse].clamp(min=1.0), 0.0).to(samples.dtype)
