"""One optimizer step on a batch of episodes (blocking; the service runs it in a worker thread)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from relayrl.config.loss import KlUse
from relayrl.config.trainer import MicroBatchLayout, TrainerConfig
from relayrl.trainer.batching import PackedBatch, Positions, pack, plan_micro_batches, plan_packed
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.losses.advantages import (
    BATCH_NORMALISED,
    Groups,
    advantages,
    moments,
    overlong_penalty,
    reinforce_pp_values,
)
from relayrl.trainer.losses.distill import distill_baselines
from relayrl.trainer.losses.kl import kl_reward_penalty
from relayrl.trainer.losses.step import LossTerms, denominator, loss_terms
from relayrl.trainer.losses.tokens import Tokens
from relayrl.trainer.optim import build_optimizer, lr_at
from relayrl.trainer.parallel_dims import full_norm, sync_gradients
from relayrl.trainer.reference import Reference, model_logprobs

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    clip_frac: float
    ratio_mean: float
    kl: float
    tokens: int
    lr: float
    importance_mean: float = 1.0  # pi_prox / pi_behav over the batch's tokens
    importance_max: float = 1.0
    logprob_diff_mean: float = 0.0  # mean |log pi_prox - log pi_behav|: trainer vs inference mismatch
    mismatch_masked_frac: float = 0.0  # share of tokens trainer.loss.mismatch_mask left out
    ref_kl: float = 0.0  # mean KL estimate against the reference model (trainer.loss.kl_coef > 0)
    teacher_kl: float = 0.0  # mean log pi - log pi_teacher over the batch's tokens (policy_loss reverse_kl)
    # host wall time (s) of the gradient pass (packing, forward, backward, all-reduces; it ends in a host sync)
    # and of the optimizer step (clipping, AdamW; it ends in float(grad_norm))
    fwd_bwd_s: float = 0.0
    optimizer_s: float = 0.0


class StepAbandoned(Exception):
    """A stop agreed by every rank at a micro-batch boundary: the step's partial gradients are discarded, no
    optimizer step is taken, and its batch stays unconsumed (pending in the stream, read again on resume)."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__(f"stopped after {done} of {total} micro-batches")
        self.done, self.total = done, total


def stop_agreed(coll: Collectives, local: bool) -> bool:
    """Whether any rank asked to stop: one all-reduce MAX of the flag with several ranks (the same call, at the
    same boundary, on every rank), the flag itself with one (no collective)."""
    if coll.world_size == 1:
        return local
    flag = torch.tensor([int(local)], dtype=torch.int64)
    coll.all_reduce(flag, dist.ReduceOp.MAX, "stop_requested")
    return bool(flag.item())


def agreed_count(coll: Collectives, local: int) -> int:
    """Micro-batches every rank runs this step: the most any rank needs (one all-reduce MAX); a rank with fewer
    pads with zero-weight ones, so every rank issues the same collectives (collectives are global contracts)."""
    n_micro = torch.tensor([local], dtype=torch.int64)
    coll.all_reduce(n_micro, dist.ReduceOp.MAX, "micro_batch_count")
    return int(n_micro.item())


def agreed_micro_batches(coll: Collectives, episodes: int, micro_batch_size: int) -> int:
    """:func:`agreed_count` of a split by sequences (``micro_batch_size`` per micro-batch)."""
    return agreed_count(coll, math.ceil(episodes / micro_batch_size))


class Learner:
    """Owns the model and optimizer; computes advantages and the loss and steps the optimizer."""

    def __init__(
        self,
        model: Any,
        cfg: TrainerConfig,
        pad_id: int,
        device: torch.device,
        max_completion_tokens: int = 1,
        collectives: Collectives | None = None,
        reference: Reference | None = None,
    ) -> None:
        self.model = model
        # the frozen model of the KL term (relayrl.trainer.reference); or None, and the reference's logprobs come
        # with the batch from an endpoint (trainer.loss.reference_address)
        self.reference = reference
        self.collectives = collectives or Collectives(None, timeout_s=60.0)
        self.max_completion_tokens = max_completion_tokens
        self.cfg = cfg
        self.pad_id = pad_id
        self.device = device
        # trainer.optimizer: the optimizer and its schedule (relayrl.trainer.optim)
        self.optimizer = build_optimizer(list(model.parameters()), cfg.optimizer)
        self.steps_done = 0
        # set (from any thread) to stop at the next micro-batch boundary of rl_step: see StepAbandoned
        self.stop = threading.Event()

    def _lr(self) -> float:
        return lr_at(self.steps_done, self.cfg.optimizer, self.cfg.total_steps)

    def _optimizer_step(self) -> tuple[float, float]:
        lr = self._lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optimizer.grad_clip if self.cfg.optimizer.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return full_norm(grad_norm), lr

    def _has_reference(self, positions: Positions) -> bool:
        return self.reference is not None or positions.reference is not None

    def _reference_logprobs(self, mb: PackedBatch) -> torch.Tensor:
        """log pi_ref of ``mb``: the endpoint's scores it carries, or the trainer's frozen copy's forward."""
        if mb.reference is not None:
            return mb.reference
        assert self.reference is not None
        return self.reference.logprobs(mb, self.cfg.logprob_chunk_positions)

    def _loss_terms(
        self, logp: torch.Tensor, mb: PackedBatch, adv: torch.Tensor, ref: torch.Tensor | None = None
    ) -> LossTerms:
        """The configured loss (relayrl.trainer.losses) over one micro-batch; ``adv`` one per sequence; ``ref``
        the reference's logprob of each token (KL in the loss), laid out like ``mb``."""
        prox = logp.detach()  # one optimizer step per batch: the proximal policy is the current one
        seq = mb.sequence_index().reshape(-1)

        def flat(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values.to(logp.dtype).reshape(-1)

        tokens = Tokens(
            logp.reshape(-1),
            prox.reshape(-1),
            mb.behaviour_logprobs.reshape(-1),
            adv.to(logp.dtype)[seq],
            mb.mask.to(logp.dtype).reshape(-1),
            seq,
            mb.sequences(),
            flat(mb.teacher),
            flat(mb.baseline),
        )
        return loss_terms(self.cfg.loss, tokens, None if ref is None else ref.reshape(-1))

    def rl_step(self, batch: StepBatch) -> StepStats:
        """Gradients over the global batch (all ranks), then one optimizer step."""
        t0 = time.monotonic()
        stats = self.rl_gradients(batch)
        t1 = time.monotonic()
        stats.grad_norm, stats.lr = self._optimizer_step()
        stats.fwd_bwd_s, stats.optimizer_s = t1 - t0, time.monotonic() - t1
        return stats

    def _advantages(self, batch: StepBatch, micro: Sequence[tuple[Sequence[int], PackedBatch]]) -> torch.Tensor:
        """Per-episode advantages after the reward shaping (overlong penalty, KL penalty) the config asks for."""
        lc = self.cfg.loss
        rewards = batch.reward + overlong_penalty(
            batch.completion_len, self.max_completion_tokens, lc.overlong_buffer_tokens, lc.overlong_penalty
        )
        rewards = rewards.to(self.device)
        if self._has_reference(batch.positions) and lc.kl_use is KlUse.REWARD and lc.kl_coef > 0:
            rewards -= self._reference_penalty(len(batch), micro)
        rewards = rewards.to(torch.float32)
        gidx = batch.group_index.to(self.device)
        batch_moments = None
        if lc.advantage in BATCH_NORMALISED:  # normalised over the global batch: every rank's moments
            batch_moments = moments(reinforce_pp_values(lc.advantage, Groups(rewards, gidx, batch.num_groups)))
            self.collectives.all_reduce(batch_moments, dist.ReduceOp.SUM, "advantage_moments")
        return advantages(lc.advantage, rewards, gidx, batch.num_groups, lc.advantage_eps, batch_moments)

    def _reference_penalty(self, n: int, micro: Sequence[tuple[Sequence[int], PackedBatch]]) -> torch.Tensor:
        """kl_coef x each episode's summed KL estimate (behaviour logprobs vs the reference), float64 [N]."""
        lc = self.cfg.loss
        out = torch.zeros(n, dtype=torch.float64, device=self.device)
        for rows, mb in micro:
            ref = self._reference_logprobs(mb)
            penalty = kl_reward_penalty(
                lc.kl_estimator,
                lc.kl_coef,
                mb.behaviour_logprobs.reshape(-1),
                ref.reshape(-1),
                mb.mask.reshape(-1),
                mb.sequence_index().reshape(-1),
                mb.sequences(),
            )
            out[torch.tensor(list(rows), dtype=torch.long, device=self.device)] = penalty
        return out

    def _plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """Micro-batches of sequences of ``lengths`` training positions (relayrl.trainer.batching)."""
        if self.cfg.micro_batch_layout is MicroBatchLayout.PACKED:
            return plan_packed(lengths, self.cfg.micro_batch_tokens)
        return plan_micro_batches(lengths, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens)

    def _micro_batch(self, positions: Positions, rows: Sequence[int]) -> PackedBatch:
        if self.cfg.micro_batch_layout is MicroBatchLayout.PACKED:
            return positions.packed(rows, self.device)
        return positions.padded(rows, self.pad_id, self.device)

    def _with_baselines(self, batch: StepBatch) -> Positions:
        """The batch's positions, with the distillation baseline of each token where a teacher scored them
        (computed per group before the split into micro-batches, so any split gives the same baselines)."""
        positions = batch.positions
        if positions.teacher is None:
            return positions
        group = torch.repeat_interleave(batch.group_index, positions.lengths)
        baseline = distill_baselines(
            self.cfg.loss.distill_baseline,
            positions.behaviour - positions.teacher,
            group,
            positions.completion_at,
            positions.mask,
        )
        return replace(positions, baseline=baseline)

    def _padding_micro_batch(self, like: Positions) -> tuple[PackedBatch, torch.Tensor]:
        """One position, zero mask and advantage: the cheapest forward/backward, contributing exactly zero (with
        zero teacher and baseline columns where ``like``'s micro-batches carry them)."""
        mb = pack([[self.pad_id]], [[self.pad_id]], None, [[0]], [1.0], self.pad_id, self.device)
        if like.teacher is not None:
            mb.teacher, mb.baseline = torch.zeros_like(mb.mask), torch.zeros_like(mb.mask)
        return mb, torch.zeros(1, dtype=torch.float32, device=self.device)

    def rl_gradients(self, batch: StepBatch) -> StepStats:
        """Accumulate into ``.grad`` the gradient of the loss over the *global* batch (every rank's episodes).

        Normalisation: the loss is the sum over all ranks' completion tokens divided by their global count
        (``token_mean``) or by global episodes x max_new_tokens (``constant``); each rank divides its local
        sum by that global denominator and the gradients are all-reduced with SUM. So 1 rank with the whole
        batch and N ranks with a share each, and any micro-batch split, compute the same gradient (up to
        summation order). Micro-batches: see relayrl.trainer.batching, each sliced once from the batch's columns
        (relayrl.trainer.ingest.StepBatch). Every rank runs the same number of micro-batches (all-reduce MAX,
        padded with zero-weight ones), and before each one agrees whether to stop (:func:`stop_agreed`,
        :class:`StepAbandoned`). One forward per micro-batch gives both the current and the proximal logprobs (one
        optimizer step per batch), and the loop never reads a tensor on the host: statistics stay tensors until
        the end.
        """
        coll = self.collectives
        self.model.train()
        positions = self._with_baselines(batch)
        plan = self._plan(positions.sizes)
        micro = [(rows, self._micro_batch(positions, rows)) for rows in plan]
        adv = self._advantages(batch, micro)
        counts = torch.tensor([batch.loss_tokens, float(len(batch))], dtype=torch.float64)
        coll.all_reduce(counts, dist.ReduceOp.SUM, "global_tokens_and_episodes")
        global_tokens = max(float(counts[0]), 1.0)
        norm = denominator(self.cfg.loss, global_tokens, float(counts[1]), self.max_completion_tokens)
        n_micro = agreed_count(coll, len(plan))
        kl_in_loss = self._has_reference(positions) and self.cfg.loss.kl_use is KlUse.LOSS
        # loss, clipped, ratio, kl, importance sum, |prox - behav| sum, mismatch-masked tokens, reference kl,
        # teacher kl
        sums = torch.zeros(9, dtype=torch.float64, device=self.device)
        importance_max = torch.zeros(1, dtype=torch.float64, device=self.device)
        # a stop at a micro-batch boundary (agreed by every rank; n_micro is, so all check equally often, at least
        # once): nothing of this step is applied yet, its partial gradients are dropped (StepAbandoned)
        for i in range(max(n_micro, 1)):
            if stop_agreed(coll, self.stop.is_set()):  # a safe point: nothing of this step is applied yet
                self.optimizer.zero_grad(set_to_none=True)
                raise StepAbandoned(i, n_micro)
            if i >= n_micro:
                break
            if i < len(plan):
                rows, mb = micro[i]
                mb_adv = adv[torch.tensor(rows, dtype=torch.long, device=self.device)]
                ref = self._reference_logprobs(mb) if kl_in_loss else None
            else:  # padding: every rank runs the same micro-batches
                mb, mb_adv = self._padding_micro_batch(positions)
                ref = torch.zeros_like(mb.behaviour_logprobs) if kl_in_loss else None
            mb_sums, mb_max = self._backward(mb, mb_adv, ref, norm)
            sums += mb_sums
            importance_max = torch.maximum(importance_max, mb_max)
        sync_gradients(self.model, coll, "gradients")
        coll.all_reduce(sums, dist.ReduceOp.SUM, "loss_stats")
        coll.all_reduce(importance_max, dist.ReduceOp.MAX, "importance_max")
        values = torch.cat([sums, importance_max]).tolist()  # the step's one host read of its statistics
        n = global_tokens
        return StepStats(
            loss=values[0] / norm,
            grad_norm=0.0,
            clip_frac=values[1] / n,
            ratio_mean=values[2] / n,
            kl=values[3] / n,
            tokens=int(n),
            lr=0.0,
            importance_mean=values[4] / n,
            importance_max=values[9],
            logprob_diff_mean=values[5] / n,
            mismatch_masked_frac=values[6] / n,
            ref_kl=values[7] / n,
            teacher_kl=values[8] / n,
        )

    def _backward(
        self, mb: PackedBatch, adv: torch.Tensor, ref: torch.Tensor | None, norm: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's forward, loss (divided by the global normaliser) and backward; its statistics as
        device tensors (float64): the sums of :meth:`rl_gradients` and the largest importance weight."""
        logp = model_logprobs(self.model, mb, self.cfg.logprob_chunk_positions)
        terms = self._loss_terms(logp, mb, adv, ref)
        (terms.loss_sum / norm).backward()
        with torch.no_grad():
            diff = (logp.detach() - mb.behaviour_logprobs) * mb.mask
            weight = torch.exp(diff) * mb.mask
            sums = torch.stack(
                [
                    terms.loss_sum.detach(),
                    terms.clipped_tokens,
                    terms.ratio_sum,
                    terms.kl_sum,
                    weight.sum(),
                    diff.abs().sum(),
                    terms.masked_tokens.to(weight.device),
                    terms.ref_kl_sum.to(weight.device),
                    terms.teacher_kl_sum.to(weight.device),
                ]
            )
            return sums.to(torch.float64), weight.max().to(torch.float64).reshape(1)

    def sft_step(self, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> StepStats:
        """Supervised step: mean cross-entropy of the answer tokens (incl. eos) given the prompt, over the
        global batch (every rank passes the same number of rows)."""
        self.model.train()
        total_tokens = torch.tensor([float(sum(len(a) for a in answers))], dtype=torch.float64)
        self.collectives.all_reduce(total_tokens, dist.ReduceOp.SUM, "sft_global_tokens")
        total_tokens = total_tokens.clamp(min=1.0).to(torch.float32)
        loss_sum = torch.zeros(1, device=self.device)
        positions = Positions.of(prompts, answers, None, None, [1.0] * len(prompts))
        for rows in self._plan(positions.sizes):  # no collective per micro-batch: counts differ by rank
            mb = positions.padded(rows, self.pad_id, self.device)
            nll = -(model_logprobs(self.model, mb, self.cfg.logprob_chunk_positions) * mb.mask).sum()
            (nll / total_tokens).backward()
            loss_sum += nll.detach()
        sync_gradients(self.model, self.collectives, "sft_gradients")
        self.collectives.all_reduce(loss_sum, dist.ReduceOp.SUM, "sft_loss")
        grad_norm, lr = self._optimizer_step()
        return StepStats(
            loss=float(loss_sum / total_tokens),
            grad_norm=grad_norm,
            clip_frac=0.0,
            ratio_mean=1.0,
            kl=0.0,
            tokens=int(total_tokens.item()),
            lr=lr,
        )
