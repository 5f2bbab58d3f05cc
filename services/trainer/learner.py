"""One optimizer step on a batch of episodes (blocking; the service runs it in a worker thread)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.trainer import LossAggregation, OffPolicyCorrection, TrainerConfig
from relayrl.trainer.batching import plan_micro_batches
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.loss import LossTerms, advantages, ppo_clip_loss, tis_loss, token_logprobs

log = logging.getLogger(__name__)


@dataclass
class PackedBatch:
    """Right-padded sequences (prompt + completion) with the completion tokens' targets aligned.

    Position t of ``input_ids`` predicts ``targets[:, t]``; ``mask`` marks the completion tokens trained on.
    """

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    targets: torch.Tensor  # [B, L] long
    mask: torch.Tensor  # [B, L] float
    behaviour_logprobs: torch.Tensor  # [B, L] float
    temperature: torch.Tensor  # [B] float


def pack(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
         behaviour: Sequence[Sequence[float]] | None, loss_masks: Sequence[Sequence[int]] | None,
         temperatures: Sequence[float], pad_id: int, device: torch.device) -> PackedBatch:
    """Rows padded to the longest sequence given (no further); one tensor built per field, on the host."""
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
    ids, attn, mask, old = [], [], [], []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        n_p, n_c = len(p), len(c)
        pad = length + 1 - n_p - n_c
        ids.append([*p, *c, *([pad_id] * pad)])
        attn.append([1] * (n_p + n_c) + [0] * pad)
        # completion token j sits at position n_p + j and is predicted from position n_p + j - 1
        lead, tail = [0.0] * (n_p - 1), [0.0] * (pad + 1)
        mask.append([*lead, *(loss_masks[i] if loss_masks is not None else [1] * n_c), *tail])
        old.append([*lead, *(behaviour[i] if behaviour is not None else [0.0] * n_c), *tail])
    ids_t = torch.tensor(ids, dtype=torch.long)
    return PackedBatch(
        input_ids=ids_t[:, :-1].to(device), attention_mask=torch.tensor(attn, dtype=torch.long)[:, :-1].to(device),
        targets=ids_t[:, 1:].to(device), mask=torch.tensor(mask, dtype=torch.float32)[:, :-1].to(device),
        behaviour_logprobs=torch.tensor(old, dtype=torch.float32)[:, :-1].to(device),
        temperature=torch.tensor(temperatures, dtype=torch.float32, device=device),
    )


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
    # host wall time (s) of the gradient pass (packing, forward, backward, all-reduces; it ends in a host sync)
    # and of the optimizer step (clipping, AdamW; it ends in float(grad_norm))
    fwd_bwd_s: float = 0.0
    optimizer_s: float = 0.0


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
    """Owns the model and optimizer; computes advantages and the loss and steps AdamW."""

    def __init__(self, model: Any, cfg: TrainerConfig, pad_id: int, device: torch.device,
                 max_completion_tokens: int = 1, collectives: Collectives | None = None) -> None:
        self.model = model
        self.collectives = collectives or Collectives(None, timeout_s=60.0)
        self.max_completion_tokens = max_completion_tokens
        self.cfg = cfg
        self.pad_id = pad_id
        self.device = device
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2),
                                           weight_decay=opt.weight_decay)
        self.steps_done = 0

    def _lr(self) -> float:
        opt = self.cfg.optimizer
        if opt.warmup_steps <= 0:
            return opt.lr
        return opt.lr * min(1.0, (self.steps_done + 1) / opt.warmup_steps)

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
        return float(grad_norm), lr

    def _loss_terms(self, logp: torch.Tensor, mb: PackedBatch, adv: torch.Tensor) -> LossTerms:
        prox = logp.detach()  # one optimizer step per batch: the proximal policy is the current one
        lc = self.cfg.loss
        if lc.off_policy is OffPolicyCorrection.NONE:
            return ppo_clip_loss(logp, mb.behaviour_logprobs, adv, mb.mask, lc.clip_eps)
        if lc.off_policy is OffPolicyCorrection.DECOUPLED_PPO:
            weights = torch.exp(prox - mb.behaviour_logprobs)
            if lc.importance_cap > 0:
                weights = weights.clamp(max=lc.importance_cap)
            return ppo_clip_loss(logp, prox, adv, mb.mask, lc.clip_eps, weights=weights)
        return tis_loss(logp, prox, mb.behaviour_logprobs, adv, mb.mask, lc.importance_cap)

    def rl_step(self, episodes: Sequence[Episode]) -> StepStats:
        """Gradients over the global batch (all ranks), then one AdamW step."""
        t0 = time.monotonic()
        stats = self.rl_gradients(episodes)
        t1 = time.monotonic()
        stats.grad_norm, stats.lr = self._optimizer_step()
        stats.fwd_bwd_s, stats.optimizer_s = t1 - t0, time.monotonic() - t1
        return stats

    def _advantages(self, episodes: Sequence[Episode]) -> torch.Tensor:
        group_ids = {g: i for i, g in enumerate(dict.fromkeys(e.group_id for e in episodes))}
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32, device=self.device)
        gidx = torch.tensor([group_ids[e.group_id] for e in episodes], dtype=torch.long, device=self.device)
        return advantages(self.cfg.loss.advantage, rewards, gidx, len(group_ids), self.cfg.loss.advantage_eps)

    def _plan(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> list[list[int]]:
        lengths = [len(p) + len(c) - 1 for p, c in zip(prompts, completions, strict=True)]
        return plan_micro_batches(lengths, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens)

    def _pack_rows(self, episodes: Sequence[Episode], rows: Sequence[int]) -> PackedBatch:
        eps = [episodes[i] for i in rows]
        return pack([e.prompt_token_ids for e in eps], [e.completion_token_ids for e in eps],
                    [e.behaviour_logprobs for e in eps], [e.loss_mask for e in eps],
                    [e.sampling_temperature or 1.0 for e in eps], self.pad_id, self.device)

    def _padding_micro_batch(self) -> tuple[PackedBatch, torch.Tensor]:
        """One position, zero mask and advantage: the cheapest forward/backward, contributing exactly zero."""
        mb = pack([[self.pad_id]], [[self.pad_id]], None, [[0]], [1.0], self.pad_id, self.device)
        return mb, torch.zeros(1, dtype=torch.float32, device=self.device)

    def rl_gradients(self, episodes: Sequence[Episode]) -> StepStats:
        """Accumulate into ``.grad`` the gradient of the loss over the *global* batch (every rank's episodes).

        Normalisation: the loss is the sum over all ranks' completion tokens divided by their global count
        (``token_mean``) or by global episodes x max_new_tokens (``constant``); each rank divides its local
        sum by that global denominator and the gradients are all-reduced with SUM. So 1 rank with the whole
        batch and N ranks with a share each, and any micro-batch split, compute the same gradient (up to
        summation order). Micro-batches: see relayrl.trainer.batching (each padded to its own longest
        sequence). Every rank runs the same number of micro-batches (all-reduce MAX, padded with zero-weight
        ones). One forward per micro-batch gives both the current and the proximal logprobs (one optimizer
        step per batch), and the loop never reads a tensor on the host: statistics stay tensors until the end.
        """
        coll = self.collectives
        self.model.train()
        adv = self._advantages(episodes)
        plan = self._plan([e.prompt_token_ids for e in episodes], [e.completion_token_ids for e in episodes])
        local_tokens = float(sum(sum(e.loss_mask) for e in episodes))  # host lists: no device sync
        counts = torch.tensor([local_tokens, float(len(episodes))], dtype=torch.float64)
        coll.all_reduce(counts, dist.ReduceOp.SUM, "global_tokens_and_episodes")
        global_tokens = max(float(counts[0]), 1.0)
        if self.cfg.loss.loss_aggregation is LossAggregation.TOKEN_MEAN:
            denominator = global_tokens
        else:
            denominator = float(counts[1]) * self.max_completion_tokens
        n_micro = agreed_count(coll, len(plan))
        # loss, clipped, ratio, kl, importance sum, |prox - behav| sum
        sums = torch.zeros(6, dtype=torch.float64, device=self.device)
        importance_max = torch.zeros(1, dtype=torch.float64, device=self.device)
        for i in range(n_micro):
            if i < len(plan):
                mb = self._pack_rows(episodes, plan[i])
                mb_adv = adv[torch.tensor(plan[i], dtype=torch.long, device=self.device)]
            else:  # padding: every rank runs the same micro-batches
                mb, mb_adv = self._padding_micro_batch()
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            logp = token_logprobs(logits, mb.targets, mb.temperature)
            terms = self._loss_terms(logp, mb, mb_adv)
            (terms.loss_sum / denominator).backward()
            with torch.no_grad():
                diff = (logp.detach() - mb.behaviour_logprobs) * mb.mask
                weight = torch.exp(diff) * mb.mask
                sums += torch.stack([terms.loss_sum.detach(), terms.clipped_tokens, terms.ratio_sum, terms.kl_sum,
                                     weight.sum(), diff.abs().sum()]).to(sums.dtype)
                importance_max = torch.maximum(importance_max, weight.max().to(importance_max.dtype))
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        coll.all_reduce_coalesced([p.grad for p in params], dist.ReduceOp.SUM, "gradients")
        coll.all_reduce(sums, dist.ReduceOp.SUM, "loss_stats")
        coll.all_reduce(importance_max, dist.ReduceOp.MAX, "importance_max")
        values = torch.cat([sums, importance_max]).tolist()  # the step's one host read of its statistics
        n = global_tokens
        return StepStats(loss=values[0] / denominator, grad_norm=0.0, clip_frac=values[1] / n,
                         ratio_mean=values[2] / n, kl=values[3] / n, tokens=int(n), lr=0.0,
                         importance_mean=values[4] / n, importance_max=values[6],
                         logprob_diff_mean=values[5] / n)

    def sft_step(self, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> StepStats:
        """Supervised step: mean cross-entropy of the answer tokens (incl. eos) given the prompt, over the
        global batch (every rank passes the same number of rows)."""
        self.model.train()
        total_tokens = torch.tensor([float(sum(len(a) for a in answers))], dtype=torch.float64)
        self.collectives.all_reduce(total_tokens, dist.ReduceOp.SUM, "sft_global_tokens")
        total_tokens = total_tokens.clamp(min=1.0).to(torch.float32)
        loss_sum = torch.zeros(1, device=self.device)
        for rows in self._plan(prompts, answers):  # no collective per micro-batch: counts may differ by rank
            mb = pack([prompts[i] for i in rows], [answers[i] for i in rows], None, None, [1.0] * len(rows),
                      self.pad_id, self.device)
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            nll = -(token_logprobs(logits, mb.targets, mb.temperature) * mb.mask).sum()
            (nll / total_tokens).backward()
            loss_sum += nll.detach()
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.collectives.all_reduce_coalesced([p.grad for p in params], dist.ReduceOp.SUM, "sft_gradients")
        self.collectives.all_reduce(loss_sum, dist.ReduceOp.SUM, "sft_loss")
        grad_norm, lr = self._optimizer_step()
        return StepStats(loss=float(loss_sum / total_tokens), grad_norm=grad_norm, clip_frac=0.0, ratio_mean=1.0,
                         kl=0.0, tokens=int(total_tokens.item()), lr=lr)
