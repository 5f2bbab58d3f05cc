"""Configuration of the trainer's algorithm (``trainer.loss``, ``trainer.teacher``, ``trainer.dynamic_sampling``):
advantage estimators, policy losses, mismatch masks, the KL term and distillation, chosen by enums and documented in
docs/algorithms.md. Part of :class:`relayrl.config.trainer.TrainerConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from relayrl.config.typed import ConfigError

OFF_POLICY_REMOVED_IN = "0.3"  # the release that stops accepting off_policy (with schema 1's flat trainer keys)


class AdvantageEstimator(StrEnum):
    GRPO = "grpo"  # (r - group mean) / (group population std + eps)
    DR_GRPO = "dr_grpo"  # r - group mean (no std normalisation; Dr. GRPO)
    RLOO = "rloo"  # r - mean of the other members of the group (leave-one-out)
    REINFORCE_PP = "reinforce_pp"  # (r - batch mean) / batch std (REINFORCE++)
    REINFORCE_PP_BASELINE = "reinforce_pp_baseline"  # r - group mean, then normalised over the batch


class PolicyLoss(StrEnum):
    PPO_CLIP = "ppo_clip"  # PPO-clip against the behaviour logprobs (asymmetric with clip_eps_high: DAPO)
    DECOUPLED_PPO = "decoupled_ppo"  # PPO-clip against proximal logprobs, times pi_prox / pi_behav
    TIS = "tis"  # policy gradient weighted by min(pi_prox / pi_behav, cap) (truncated importance sampling)
    GSPO = "gspo"  # sequence-level (length-normalised) ratio, clipped per sequence
    CISPO = "cispo"  # REINFORCE with the clipped, detached importance ratio as weight (every token keeps a gradient)
    REVERSE_KL = "reverse_kl"  # on-policy distillation: PPO-clip, advantage A - coef (log pi_behav - log pi_T - b)


class DistillBaseline(StrEnum):
    NONE = "none"  # the raw sample (Thinking Machines' on-policy distillation)
    GROUP = "group"  # the mean reverse-KL sample of the group's tokens at the same completion position


class MismatchMask(StrEnum):
    NONE = "none"
    TOKEN = "token"  # IcePop: tokens with pi_prox / pi_behav outside [low, high] leave the loss
    SEQUENCE = "sequence"  # sequences whose product of ratios is outside [low, high]
    GEOMETRIC = "geometric"  # sequences whose geometric-mean ratio is outside [low, high]


class KlEstimator(StrEnum):
    K1 = "k1"  # log pi - log pi_ref
    K2 = "k2"  # (log pi - log pi_ref)^2 / 2
    K3 = "k3"  # pi_ref / pi - 1 - log(pi_ref / pi)


class KlUse(StrEnum):
    LOSS = "loss"  # kl_coef x token-mean KL added to the loss (with gradient)
    REWARD = "reward"  # kl_coef x the sequence's summed KL subtracted from its reward before advantages


class OffPolicyCorrection(StrEnum):
    """Deprecated: the former choice of loss, now PolicyLoss (none -> ppo_clip)."""

    NONE = "none"  # PPO-clip against the behaviour logprobs
    DECOUPLED_PPO = "decoupled_ppo"  # PPO-clip against proximal logprobs, times pi_prox / pi_behav
    TIS = "tis"  # policy gradient weighted by min(pi_prox / pi_behav, cap) (truncated importance sampling)


class LossAggregation(StrEnum):
    TOKEN_MEAN = "token_mean"  # sum over completion tokens / their count in the global batch
    CONSTANT = "constant"  # sum over completion tokens / (episodes x rollout.max_new_tokens) (Dr. GRPO)
    SEQUENCE_MEAN = "sequence_mean"  # mean over episodes of each episode's token mean (GRPO, GSPO)


OFF_POLICY_TO_LOSS = {
    OffPolicyCorrection.NONE: PolicyLoss.PPO_CLIP,
    OffPolicyCorrection.DECOUPLED_PPO: PolicyLoss.DECOUPLED_PPO,
    OffPolicyCorrection.TIS: PolicyLoss.TIS,
}


@dataclass
class LossConfig:
    clip_eps: float = field(
        default=0.2,
        metadata={
            "help": "PPO ratio clip range epsilon (the lower one, 1 - clip_eps, when clip_eps_high is set).",
            "gt": 0,
        },
    )
    clip_eps_high: float = field(
        default=0.0,
        metadata={
            "help": "Upper clip range: ratios are clipped to [1 - clip_eps, 1 + clip_eps_high] (DAPO's clip-higher, "
            "e.g. 0.28; 0: the same as clip_eps). Used by ppo_clip, decoupled_ppo, gspo and cispo.",
            "ge": 0,
        },
    )
    advantage: AdvantageEstimator = field(
        default=AdvantageEstimator.GRPO,
        metadata={
            "help": "Advantage estimator: grpo = (r - group mean) / (group population std + eps); dr_grpo = "
            "r - group mean; rloo = r - mean of the other group members; reinforce_pp = (r - batch mean) / "
            "batch std; reinforce_pp_baseline = r - group mean, then normalised over the batch."
        },
    )
    policy_loss: PolicyLoss = field(
        default=PolicyLoss.PPO_CLIP,
        metadata={
            "help": "Policy loss: ppo_clip = PPO-clip against behaviour logprobs; decoupled_ppo = PPO-clip against "
            "the trainer's proximal logprobs times pi_prox/pi_behav; tis = policy gradient times "
            "min(pi_prox/pi_behav, importance_cap); gspo = sequence-level length-normalised ratio, clipped "
            "per sequence; cispo = policy gradient times the clipped, detached ratio; reverse_kl = on-policy "
            "distillation: ppo_clip with each token's advantage minus distill_coef x (log pi_behav - "
            "log pi_teacher - distill_baseline) "
            "(needs trainer.teacher; docs/algorithms.md)."
        },
    )
    off_policy: OffPolicyCorrection = field(
        default=OffPolicyCorrection.NONE,
        metadata={
            "help": "Former choice of the loss: none = ppo_clip, decoupled_ppo, tis. Use policy_loss.",
            "deprecated": "use trainer.loss.policy_loss",
            "removed_in": OFF_POLICY_REMOVED_IN,
        },
    )
    importance_cap: float = field(
        default=2.0,
        metadata={
            "help": "Cap C of the importance weight pi_prox/pi_behav for tis (and decoupled_ppo when > 0; "
            "0 leaves decoupled_ppo uncapped).",
            "ge": 0,
        },
    )
    loss_aggregation: LossAggregation = field(
        default=LossAggregation.TOKEN_MEAN,
        metadata={
            "help": "How token losses are normalised over the global batch: token_mean (DAPO's token-level), "
            "constant (Dr. GRPO) or sequence_mean (each episode's token mean, averaged over episodes)."
        },
    )
    advantage_eps: float = field(default=1e-6, metadata={"help": "Epsilon of the std normalisation.", "gt": 0})
    mismatch_mask: MismatchMask = field(
        default=MismatchMask.NONE,
        metadata={
            "help": "Mask against train/inference mismatch, independent of the loss: token (IcePop), sequence "
            "(product of ratios) or geometric (geometric-mean ratio) outside [mismatch_low, mismatch_high] "
            "leave the loss; none."
        },
    )
    mismatch_low: float = field(
        default=0.5, metadata={"help": "Lower bound of pi_prox/pi_behav kept by mismatch_mask.", "gt": 0, "le": 1}
    )
    mismatch_high: float = field(
        default=2.0, metadata={"help": "Upper bound of pi_prox/pi_behav kept by mismatch_mask.", "ge": 1}
    )
    overlong_buffer_tokens: int = field(
        default=0,
        metadata={
            "help": "DAPO's soft overlong penalty: completions longer than rollout.max_new_tokens minus this many "
            "tokens lose up to overlong_penalty reward, linearly (0: off).",
            "ge": 0,
        },
    )
    overlong_penalty: float = field(
        default=1.0, metadata={"help": "Largest reward penalty of the overlong buffer.", "ge": 0}
    )
    distill_coef: float = field(
        default=1.0,
        metadata={
            "help": "reverse_kl (on-policy distillation): weight of the per-token reverse-KL sample log pi_behav - "
            "log pi_teacher subtracted from each token's advantage (the teacher is trainer.teacher).",
            "ge": 0,
        },
    )
    distill_baseline: DistillBaseline = field(
        default=DistillBaseline.NONE,
        metadata={
            "help": "reverse_kl: baseline subtracted from each token's reverse-KL sample before it enters the "
            "advantage: none = the raw sample (Thinking Machines' form); group = the mean sample of the group's "
            "tokens at the same completion position (as GRPO's group mean: removes the sample's common offset, ~KL, "
            "which adds noise early, but like GRPO it gives a group that sampled alike no signal, so a student "
            "collapsed on a wrong token stays there; docs/algorithms.md)."
        },
    )
    kl_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the KL against a frozen reference model (the initial weights, held by the trainer; "
            "0: no reference model is loaded).",
            "ge": 0,
        },
    )
    reference_address: str = field(
        default="",
        metadata={
            "help": "host:port of an inference service serving the reference weights (e.g. the initial model): its "
            "ScoreTokens gives log pi_ref of each batch's tokens instead of a frozen copy in the trainer's "
            "memory (kl_coef > 0; empty: the copy). Deadline and call size as trainer.teacher."
        },
    )
    kl_estimator: KlEstimator = field(
        default=KlEstimator.K3,
        metadata={
            "help": "KL estimator per token: k1 = log pi - log pi_ref; k2 = (log pi - log pi_ref)^2 / 2; "
            "k3 = pi_ref/pi - 1 - log(pi_ref/pi)."
        },
    )
    kl_use: KlUse = field(
        default=KlUse.LOSS,
        metadata={
            "help": "loss: kl_coef x the token KL is added to every token's loss; reward: kl_coef x the episode's "
            "summed KL (behaviour logprobs vs reference) is subtracted from its reward before advantages."
        },
    )

    def effective_policy_loss(self) -> PolicyLoss:
        """policy_loss, or the deprecated off_policy's equivalent when only that is set."""
        if self.off_policy is not OffPolicyCorrection.NONE and self.policy_loss is PolicyLoss.PPO_CLIP:
            return OFF_POLICY_TO_LOSS[self.off_policy]
        return self.policy_loss

    def clip_high(self) -> float:
        return self.clip_eps_high or self.clip_eps

    def validate(self) -> None:
        mapped = OFF_POLICY_TO_LOSS[self.off_policy]
        if self.off_policy is not OffPolicyCorrection.NONE and self.policy_loss not in (PolicyLoss.PPO_CLIP, mapped):
            raise ConfigError(
                "off_policy",
                self.off_policy.value,
                f"contradicts policy_loss {self.policy_loss.value}; set only policy_loss",
            )
        if self.effective_policy_loss() is PolicyLoss.TIS and self.importance_cap <= 0:
            raise ConfigError("importance_cap", self.importance_cap, "must be > 0 when policy_loss is tis")
        if self.effective_policy_loss() is PolicyLoss.CISPO and self.clip_eps >= 1:
            raise ConfigError("clip_eps", self.clip_eps, "must be < 1 for cispo (its weight is >= 1 - clip_eps)")


@dataclass
class TeacherConfig:
    address: str = field(
        default="",
        metadata={
            "help": "host:port of an inference service serving the teacher (same tokenizer as the student) whose "
            "ScoreTokens RPC gives the teacher's logprobs of the student's sampled tokens, for policy_loss "
            "reverse_kl (empty: no teacher)."
        },
    )
    timeout_s: float = field(
        default=120.0, metadata={"help": "Deadline of one ScoreTokens call to the teacher.", "gt": 0}
    )
    sequences_per_call: int = field(
        default=64,
        metadata={
            "help": "Episodes scored per ScoreTokens call (within the teacher's inference.max_samples_per_request).",
            "ge": 1,
        },
    )


@dataclass
class DynamicSamplingConfig:
    enabled: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: groups whose valid episodes all have the same reward (zero advantage "
            "under a group baseline) are dropped, recorded in Redis and counted (groups_dropped_zero_advantage); the "
            "trainer reads more groups in their place and rollout's admission lets it produce replacements."
        },
    )
    max_drop_ratio: float = field(
        default=3.0,
        metadata={
            "help": "Bound of the drops: each rank drops at most max_drop_ratio x its share of groups_per_step "
            "zero-advantage groups per step; past it such groups are trained (with zero advantage) so a step "
            "never waits for ever on a task the policy has solved or cannot solve.",
            "ge": 0,
        },
    )
