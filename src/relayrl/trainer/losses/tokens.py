"""The token view every loss works on: flat per-token tensors with the sequence each token belongs to.

Both micro-batch layouts flatten to it: right-padded rows ``[B, T]`` (``seq`` = the row) and packed rows with
several sequences each (``seq`` = the sequence's index in the micro-batch). Sequence-level quantities (GSPO's
ratio, sequence and geometric-mean masks, sequence-mean aggregation) are segment sums over ``seq``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from relayrl.config.loss import LossAggregation


@dataclass(frozen=True)
class Tokens:
    """One micro-batch's completion tokens, flat. Positions with ``mask == 0`` contribute nothing."""

    logp: torch.Tensor  # [N] log pi_theta (with gradient)
    prox: torch.Tensor  # [N] log pi_prox (the trainer's weights before this update; no gradient)
    behaviour: torch.Tensor  # [N] log pi_behav (inference's logprobs of the sampled token)
    advantages: torch.Tensor  # [N] the advantage of each token's sequence
    mask: torch.Tensor  # [N] float: 1 for tokens trained on
    seq: torch.Tensor  # [N] long: the token's sequence, in [0, num_seqs)
    num_seqs: int
    teacher: torch.Tensor | None = None  # [N] log pi_teacher of the sampled token (on-policy distillation)
    distill_baseline: torch.Tensor | None = None  # [N] baseline of its reverse-KL sample (None: 0)

    @staticmethod
    def from_rows(
        logp: torch.Tensor, prox: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> Tokens:
        """Right-padded rows ``[B, T]`` with one advantage per row ``[B]``: one sequence per row."""
        assert logp.shape == prox.shape == behaviour.shape == mask.shape, (logp.shape, mask.shape)
        assert advantages.shape == logp.shape[:1], (advantages.shape, logp.shape)
        b, t = logp.shape
        seq = torch.arange(b, device=logp.device).repeat_interleave(t)
        adv = advantages.to(logp.dtype).unsqueeze(1).expand(b, t).reshape(-1)
        return Tokens(
            logp.reshape(-1), prox.reshape(-1), behaviour.reshape(-1), adv, mask.to(logp.dtype).reshape(-1), seq, b
        )

    def with_mask(self, mask: torch.Tensor) -> Tokens:
        return replace(self, mask=mask)

    def seq_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums ``[num_seqs]`` of ``values * mask``."""
        out = torch.zeros(self.num_seqs, dtype=values.dtype, device=values.device)
        return out.index_add_(0, self.seq, values * self.mask.to(values.dtype))

    def seq_lengths(self) -> torch.Tensor:
        """Tokens trained on per sequence ``[num_seqs]`` (at least 1, so a division is always defined)."""
        return self.seq_sum(torch.ones_like(self.mask)).clamp(min=1.0)


def aggregation_weights(kind: LossAggregation, t: Tokens) -> torch.Tensor:
    """Per-token factor applied before the global sum: 1 for token_mean and constant (the caller divides by
    global tokens, or episodes x max_new_tokens), ``1 / |y_i|`` for sequence_mean (the caller divides by the
    global number of sequences)."""
    if kind is LossAggregation.SEQUENCE_MEAN:
        return (1.0 / t.seq_lengths())[t.seq].to(t.logp.dtype)
    return torch.ones_like(t.logp)
