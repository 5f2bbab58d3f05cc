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

from collections.abc import Sequence

from relayrl.config.loss import DistillBaseline


def distill_baselines(kind: DistillBaseline, samples: Sequence[Sequence[float]], groups: Sequence[str],
                      masks: Sequence[Sequence[int]]) -> list[list[float]]:
    """Per episode, per completion token: the baseline of its reverse-KL sample. ``samples[i][t]`` is episode
    i's log pi_behav - log pi_teacher at completion position t; ``groups[i]`` its group; ``masks[i][t]`` 0 for
    a token out of the loss (it neither enters a mean nor needs a baseline: 0). ``group``: the mean of the
    samples of the trained tokens at position t of the group's episodes (the token's own included, as GRPO's
    mean; a lone token's baseline is itself); ``none``: zeros."""
    if kind is DistillBaseline.NONE:
        return [[0.0] * len(s) for s in samples]
    sums: dict[tuple[str, int], float] = {}
    counts: dict[tuple[str, int], int] = {}
    for s, g, m in zip(samples, groups, masks, strict=True):
        for t, (v, keep) in enumerate(zip(s, m, strict=True)):
            if keep:
                sums[g, t] = sums.get((g, t), 0.0) + v
                counts[g, t] = counts.get((g, t), 0) + 1
    return [[sums[g, t] / counts[g, t] if keep else 0.0 for t, keep in enumerate(m)]
            for g, m in zip(groups, masks, strict=True)]
