"""Configuration of the trainer service.

Sections, in order of how often they are set: the run's length and batch at the top, then ``optimizer``,
``loss``, ``sft``, ``checkpoint``, ``publication`` (weights to inference), ``distributed`` (ranks), ``stream``
(reading groups from Redis), and the servers. The flat keys of schema 1 (``trainer.lr``,
``trainer.checkpoint_every``, ...) still load: ``MOVED_FIELDS`` maps each onto its nested field, with a warning
naming the new key (see :mod:`relayrl.common.config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Literal

from relayrl.common.config import ConfigError
from relayrl.config.endpoints import HttpConfig, ServerConfig, http_config, server_config
from relayrl.config.evaluation import InRunEvalConfig
from relayrl.config.threads import ThreadsConfig

DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024  # bytes per weight-update chunk: well under gRPC's default 4 MiB message limit
FLAT_KEYS_REMOVED_IN = "0.3"  # the release that stops accepting the flat keys of MOVED_FIELDS


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


class WeightTransport(StrEnum):
    """The config's choice of transport; the implementations are relayrl.trainer.transports.Transport."""

    GRPC_STREAM = "grpc_stream"
    SHARED_PATH = "shared_path"
    SHARED_MEMORY = "shared_memory"  # same host: a file in the weights directory, page cache, only the manifest on gRPC
    AUTO = "auto"  # shared_memory under `relayrl run` (one host, one output folder), else grpc_stream


class LossAggregation(StrEnum):
    TOKEN_MEAN = "token_mean"  # sum over completion tokens / their count in the global batch
    CONSTANT = "constant"  # sum over completion tokens / (episodes x rollout.max_new_tokens) (Dr. GRPO)
    SEQUENCE_MEAN = "sequence_mean"  # mean over episodes of each episode's token mean (GRPO, GSPO)


class MicroBatchLayout(StrEnum):
    PADDED = "padded"  # one sequence per row, rows padded to the micro-batch's longest
    PACKED = "packed"  # several sequences per row up to micro_batch_tokens, separated by their position ids


class RewardErrorPolicy(StrEnum):
    DROP = "drop"  # exclude errored episodes from the loss and count them
    FAIL = "fail"  # stop the trainer with an error naming the episode


class AfterFinish(StrEnum):
    EXIT = "exit"  # exit 0 after linger_s (a launcher, a Job)
    STAY = "stay"  # keep answering status (finished) until SIGTERM (an always-restarting workload: a StatefulSet)


@dataclass
class OptimizerConfig:
    lr: float = field(default=1e-3, metadata={"help": "AdamW learning rate.", "gt": 0})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay.", "ge": 0})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1.", "ge": 0, "lt": 1})
    beta2: float = field(default=0.99, metadata={"help": "AdamW beta2.", "ge": 0, "lt": 1})
    warmup_steps: int = field(default=0, metadata={"help": "Linear learning-rate warm-up steps.", "ge": 0})
    grad_clip: float = field(default=1.0, metadata={"help": "Max gradient norm (0: no clipping).", "ge": 0})
    master_weights: bool = field(default=True, metadata={
        "help": "With model.dtype bfloat16 or float16 and trained parameters in that dtype (full fine-tuning): AdamW "
                "steps float32 master copies (moments in float32 too) and writes them back rounded, so updates "
                "smaller than the dtype's rounding accumulate instead of being lost. Costs 12 bytes per trained "
                "parameter. false: AdamW steps the low-precision parameters directly."})


OFF_POLICY_TO_LOSS = {OffPolicyCorrection.NONE: PolicyLoss.PPO_CLIP,
                      OffPolicyCorrection.DECOUPLED_PPO: PolicyLoss.DECOUPLED_PPO,
                      OffPolicyCorrection.TIS: PolicyLoss.TIS}


@dataclass
class LossConfig:
    clip_eps: float = field(default=0.2, metadata={
        "help": "PPO ratio clip range epsilon (the lower one, 1 - clip_eps, when clip_eps_high is set).", "gt": 0})
    clip_eps_high: float = field(default=0.0, metadata={
        "help": "Upper clip range: ratios are clipped to [1 - clip_eps, 1 + clip_eps_high] (DAPO's clip-higher, "
                "e.g. 0.28; 0: the same as clip_eps). Used by ppo_clip, decoupled_ppo, gspo and cispo.", "ge": 0})
    advantage: AdvantageEstimator = field(default=AdvantageEstimator.GRPO, metadata={
        "help": "Advantage estimator: grpo = (r - group mean) / (group population std + eps); dr_grpo = "
                "r - group mean; rloo = r - mean of the other group members; reinforce_pp = (r - batch mean) / "
                "batch std; reinforce_pp_baseline = r - group mean, then normalised over the batch."})
    policy_loss: PolicyLoss = field(default=PolicyLoss.PPO_CLIP, metadata={
        "help": "Policy loss: ppo_clip = PPO-clip against behaviour logprobs; decoupled_ppo = PPO-clip against "
                "the trainer's proximal logprobs times pi_prox/pi_behav; tis = policy gradient times "
                "min(pi_prox/pi_behav, importance_cap); gspo = sequence-level length-normalised ratio, clipped "
                "per sequence; cispo = policy gradient times the clipped, detached ratio; reverse_kl = on-policy "
                "distillation: ppo_clip with each token's advantage minus distill_coef x (log pi_behav - "
                "log pi_teacher - distill_baseline) "
                "(needs trainer.teacher; docs/algorithms.md)."})
    off_policy: OffPolicyCorrection = field(default=OffPolicyCorrection.NONE, metadata={
        "help": "Former choice of the loss: none = ppo_clip, decoupled_ppo, tis. Use policy_loss.",
        "deprecated": "use trainer.loss.policy_loss", "removed_in": FLAT_KEYS_REMOVED_IN})
    importance_cap: float = field(default=2.0, metadata={
        "help": "Cap C of the importance weight pi_prox/pi_behav for tis (and decoupled_ppo when > 0; "
                "0 leaves decoupled_ppo uncapped).", "ge": 0})
    loss_aggregation: LossAggregation = field(default=LossAggregation.TOKEN_MEAN, metadata={
        "help": "How token losses are normalised over the global batch: token_mean (DAPO's token-level), "
                "constant (Dr. GRPO) or sequence_mean (each episode's token mean, averaged over episodes)."})
    advantage_eps: float = field(default=1e-6, metadata={"help": "Epsilon of the std normalisation.", "gt": 0})
    mismatch_mask: MismatchMask = field(default=MismatchMask.NONE, metadata={
        "help": "Mask against train/inference mismatch, independent of the loss: token (IcePop), sequence "
                "(product of ratios) or geometric (geometric-mean ratio) outside [mismatch_low, mismatch_high] "
                "leave the loss; none."})
    mismatch_low: float = field(default=0.5, metadata={
        "help": "Lower bound of pi_prox/pi_behav kept by mismatch_mask.", "gt": 0, "le": 1})
    mismatch_high: float = field(default=2.0, metadata={
        "help": "Upper bound of pi_prox/pi_behav kept by mismatch_mask.", "ge": 1})
    overlong_buffer_tokens: int = field(default=0, metadata={
        "help": "DAPO's soft overlong penalty: completions longer than rollout.max_new_tokens minus this many "
                "tokens lose up to overlong_penalty reward, linearly (0: off).", "ge": 0})
    overlong_penalty: float = field(default=1.0, metadata={
        "help": "Largest reward penalty of the overlong buffer.", "ge": 0})
    distill_coef: float = field(default=1.0, metadata={
        "help": "reverse_kl (on-policy distillation): weight of the per-token reverse-KL sample log pi_behav - "
                "log pi_teacher subtracted from each token's advantage (the teacher is trainer.teacher).", "ge": 0})
    distill_baseline: DistillBaseline = field(default=DistillBaseline.NONE, metadata={
        "help": "reverse_kl: baseline subtracted from each token's reverse-KL sample before it enters the advantage: "
                "none = the raw sample (Thinking Machines' form); group = the mean sample of the group's tokens at "
                "the same completion position (as GRPO's group mean: removes the sample's common offset, ~KL, "
                "which adds noise early, but like GRPO it gives a group that sampled alike no signal, so a student "
                "collapsed on a wrong token stays there; docs/algorithms.md)."})
    kl_coef: float = field(default=0.0, metadata={
        "help": "Weight of the KL against a frozen reference model (the initial weights, held by the trainer; "
                "0: no reference model is loaded).", "ge": 0})
    reference_address: str = field(default="", metadata={
        "help": "host:port of an inference service serving the reference weights (e.g. the initial model): its "
                "ScoreTokens gives log pi_ref of each batch's tokens instead of a frozen copy in the trainer's "
                "memory (kl_coef > 0; empty: the copy). Deadline and call size as trainer.teacher."})
    kl_estimator: KlEstimator = field(default=KlEstimator.K3, metadata={
        "help": "KL estimator per token: k1 = log pi - log pi_ref; k2 = (log pi - log pi_ref)^2 / 2; "
                "k3 = pi_ref/pi - 1 - log(pi_ref/pi)."})
    kl_use: KlUse = field(default=KlUse.LOSS, metadata={
        "help": "loss: kl_coef x the token KL is added to every token's loss; reward: kl_coef x the episode's "
                "summed KL (behaviour logprobs vs reference) is subtracted from its reward before advantages."})

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
            raise ConfigError("off_policy", self.off_policy.value,
                              f"contradicts policy_loss {self.policy_loss.value}; set only policy_loss")
        if self.effective_policy_loss() is PolicyLoss.TIS and self.importance_cap <= 0:
            raise ConfigError("importance_cap", self.importance_cap, "must be > 0 when policy_loss is tis")
        if self.effective_policy_loss() is PolicyLoss.CISPO and self.clip_eps >= 1:
            raise ConfigError("clip_eps", self.clip_eps, "must be < 1 for cispo (its weight is >= 1 - clip_eps)")


@dataclass
class TeacherConfig:
    address: str = field(default="", metadata={
        "help": "host:port of an inference service serving the teacher (same tokenizer as the student) whose "
                "ScoreTokens RPC gives the teacher's logprobs of the student's sampled tokens, for policy_loss "
                "reverse_kl (empty: no teacher)."})
    timeout_s: float = field(default=120.0, metadata={
        "help": "Deadline of one ScoreTokens call to the teacher.", "gt": 0})
    sequences_per_call: int = field(default=64, metadata={
        "help": "Episodes scored per ScoreTokens call (within the teacher's inference.max_samples_per_request).",
        "ge": 1})


@dataclass
class DynamicSamplingConfig:
    enabled: bool = field(default=False, metadata={
        "help": "DAPO's dynamic sampling: groups whose valid episodes all have the same reward (zero advantage under "
                "a group baseline) are dropped, recorded in Redis and counted (groups_dropped_zero_advantage); the "
                "trainer reads more groups in their place and rollout's admission lets it produce replacements."})
    max_drop_ratio: float = field(default=3.0, metadata={
        "help": "Bound of the drops: each rank drops at most max_drop_ratio x its share of groups_per_step "
                "zero-advantage groups per step; past it such groups are trained (with zero advantage) so a step "
                "never waits for ever on a task the policy has solved or cannot solve.", "ge": 0})


@dataclass
class SftConfig:
    warmup_steps: int = field(default=0, metadata={
        "help": "Supervised steps on (prompt, answer) pairs of the rollout dataset before RL (0: none). They "
                "are logged with phase=sft and do not publish weight versions until the first RL step."})
    batch_size: int = field(default=64, metadata={"help": "Rows per supervised warm-up step.", "ge": 1})


@dataclass
class CheckpointConfig:
    every: int = field(default=50, metadata={
        "help": "Save a checkpoint every N steps (0: only at the end).", "ge": 0})
    keep: int = field(default=2, metadata={"help": "Checkpoints kept on disk.", "ge": 1})
    resume: Literal["never", "auto"] = field(default="never", metadata={
        "help": "auto: restore the newest complete checkpoint under <output_dir>/checkpoints if there is one."})


@dataclass
class PublicationConfig:
    transport: WeightTransport = field(default=WeightTransport.AUTO, metadata={
        "help": "How weights reach inference: grpc_stream (chunks on the UpdateWeights stream), shared_path "
                "(a safetensors file under <output_dir>/weights that inference reads; needs a shared "
                "filesystem), shared_memory (same host: a file in that folder written once without fsync, removed "
                "once served; only the manifest on gRPC) or auto (shared_memory under `relayrl run`, where every "
                "service runs on one host with one output folder; grpc_stream for services started on their "
                "own)."})
    chunk_bytes: int = field(default=DEFAULT_CHUNK_BYTES, metadata={
        "help": "Bytes per weight-update chunk (under gRPC's 4 MiB message limit).", "ge": 1024,
        "le": 4 * 1024 * 1024 - 4096})
    push_timeout_s: float = field(default=60.0, metadata={
        "help": "Deadline of one weight push to inference.", "gt": 0})
    probe_sequences: int = field(default=4, metadata={
        "help": "Sequences of the probe batch inference scores after a weight swap when a probe is due (see "
                "probe_every).", "ge": 1})
    probe_tokens: int = field(default=16, metadata={
        "help": "Tokens per probe sequence (16 x 4 sequences: every layer and 64 vocabulary rows take part; a reload "
                "that leaves a layer behind moves every logprob).", "ge": 2})
    probe_every: int = field(default=10, metadata={
        "help": "Score the probe on the first publication, then on every N-th (0: never again). Every publication "
                "is verified exactly in any case where the engine can (native): the checksum of the bytes sent "
                "matches what inference received, and every module path of every updated parameter (tied "
                "aliases included) reads those very tensors after the swap. The probe adds an end-to-end "
                "check of the forward pass (logprob parity), at the cost of a forward pass on each side; an "
                "engine that cannot confirm the served weights (vLLM) is probed on every publication.", "ge": 0})
    overlap: bool = field(default=True, metadata={
        "help": "Push each step's weights in the background while the trainer reads and trains its next batch "
                "(the version is allocated before the push, so staleness stays exact; the push is awaited before "
                "the next publication and every checkpoint). false: the step waits for its push."})
    probe_tolerance: float = field(default=0.0, metadata={
        "help": "Largest accepted |logprob difference| between trainer and inference on the probe (0: by dtype: "
                "float32 1e-3, float16 2e-2, bfloat16 1e-1). Above it the trainer stops.", "ge": 0})


@dataclass
class DistributedConfig:
    world_size: int = field(default=1, metadata={
        "help": "Trainer ranks. `relayrl run` starts them with torchrun; `relayrl serve trainer` must run under "
                "torchrun with this many processes. groups_per_step must be divisible by it.", "ge": 1})
    collective_timeout_s: float = field(default=120.0, metadata={
        "help": "Timeout of every collective: a dead or diverged rank fails the others within it.", "gt": 0})
    dp_shard: int = field(default=1, metadata={
        "help": "Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2 fully_shard; 1: "
                "every rank holds the whole model). With dp_shard > 1 every rank writes its shards of each "
                "checkpoint (torch.distributed.checkpoint under <checkpoint>/dcp, so the checkpoint directory must be "
                "shared by the ranks), rank 0 still exports the Hugging Face directory, and each publication gathers "
                "the full tensors one parameter at a time, rank 0 writing each into a file under the weights "
                "directory as it arrives (any transport). Not with model.lora.", "ge": 1})
    dp_replicate: int = field(default=0, metadata={
        "help": "Data-parallel replicas of the sharded model (0: world_size / dp_shard). world_size must equal "
                "dp_replicate x dp_shard x tp x cp.", "ge": 0})
    tp: int = field(default=1, metadata={"help": "Tensor-parallel degree (only 1 for now).", "ge": 1, "le": 1})
    cp: int = field(default=1, metadata={"help": "Context-parallel degree (only 1 for now).", "ge": 1, "le": 1})
    param_dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata={
        "help": "FSDP2 mixed precision: dtype of the unsharded parameters in forward and backward."})
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata={
        "help": "FSDP2 mixed precision: dtype of the gradient reduction."})
    record_collectives: bool = field(default=False, metadata={
        "help": "Debug: record every collective per rank under <output_dir>/collectives "
                "(read with: relayrl debug collectives RUN_DIR)."})


@dataclass
class StreamReadConfig:
    consumer: str = field(default="trainer", metadata={
        "help": "Redis consumer name prefix: rank r reads as <consumer>-rank<r> (stable across restarts)."})
    read_block_ms: int = field(default=500, metadata={"help": "XREADGROUP block time.", "ge": 1})
    dead_letter_maxlen: int = field(default=10000, metadata={
        "help": "Entries kept (MAXLEN: the oldest go) in the dead-letter stream <redis.stream>:dead, where the "
                "trainer moves entries it cannot decode or validate (they are counted in episodes_invalid "
                "whatever this bound).", "ge": 1})


@dataclass
class TrainerConfig:
    # schema-1 flat key -> its field now (dotted, under trainer); each loads with a deprecation warning
    MOVED_FIELDS: ClassVar[dict[str, str]] = {
        **{k: f"optimizer.{k}" for k in ("lr", "weight_decay", "beta1", "beta2", "warmup_steps", "grad_clip")},
        **{k: f"loss.{k}" for k in ("clip_eps", "advantage", "off_policy", "importance_cap", "loss_aggregation",
                                    "advantage_eps")},
        "sft_warmup_steps": "sft.warmup_steps", "sft_batch_size": "sft.batch_size",
        "checkpoint_every": "checkpoint.every", "keep_checkpoints": "checkpoint.keep", "resume": "checkpoint.resume",
        "weight_transport": "publication.transport", "weight_chunk_bytes": "publication.chunk_bytes",
        "weight_push_timeout_s": "publication.push_timeout_s",
        **{k: f"publication.{k}" for k in ("probe_sequences", "probe_tokens", "probe_tolerance")},
        **{k: f"distributed.{k}" for k in ("world_size", "collective_timeout_s", "record_collectives")},
        "consumer": "stream.consumer", "read_block_ms": "stream.read_block_ms",
    }
    MOVED_REMOVED_IN: ClassVar[str] = FLAT_KEYS_REMOVED_IN

    total_steps: int = field(default=100, metadata={"help": "Optimizer steps to run, then stop.", "ge": 1})
    groups_per_step: int = field(default=8, metadata={
        "help": "Complete groups (prompts) per optimizer step: the batch is groups_per_step x group_size "
                "episodes.", "ge": 1})
    micro_batch_size: int = field(default=64, metadata={
        "help": "Sequences per forward/backward when micro_batch_tokens is 0 (sequences sorted by length, each "
                "micro-batch padded to its own longest).", "ge": 1})
    micro_batch_tokens: int = field(default=0, metadata={
        "help": "Token budget per forward/backward: sequences sorted by length fill a micro-batch while rows x "
                "its longest sequence stays within the budget (a longer sequence goes alone); 0: split by "
                "micro_batch_size. The loss does not depend on the split.", "ge": 0})
    micro_batch_layout: MicroBatchLayout = field(default=MicroBatchLayout.PADDED, metadata={
        "help": "padded: one sequence per row, each micro-batch padded to its longest; packed: sequences "
                "concatenated into one row of at most micro_batch_tokens positions (first-fit decreasing), "
                "attention kept within each sequence by its position ids (needs micro_batch_tokens > 0 and a "
                "model whose attention honours packed position ids, e.g. transformers' Qwen2/Llama with sdpa, "
                "eager or flash attention)."})
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata={
        "help": "AdamW and its learning-rate schedule."})
    loss: LossConfig = field(default_factory=LossConfig, metadata={
        "help": "Advantages, the policy loss and its off-policy correction."})
    on_reward_error: RewardErrorPolicy = field(default=RewardErrorPolicy.DROP, metadata={
        "help": "Episodes whose scoring failed (reward status ERROR or TIMEOUT): drop = exclude them from the "
                "loss and count them (episodes_dropped_reward_error); a group is trained on its valid episodes "
                "(advantages over those only) and dropped whole (groups_dropped_reward_error) when none is valid; "
                "fail = stop the trainer with an error naming the episode."})
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig, metadata={
        "help": "Dropping (and counting) zero-advantage groups so a step trains on informative ones (DAPO)."})
    teacher: TeacherConfig = field(default_factory=TeacherConfig, metadata={
        "help": "The teacher of on-policy distillation (policy_loss reverse_kl), reached over its inference endpoint."})
    sft: SftConfig = field(default_factory=SftConfig, metadata={"help": "Supervised warm-up before RL."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={
        "help": "Checkpoints under <output_dir>/checkpoints, and resuming from them."})
    publication: PublicationConfig = field(default_factory=PublicationConfig, metadata={
        "help": "Publishing weight versions to inference and verifying them by the probe."})
    eval: InRunEvalConfig = field(default_factory=InRunEvalConfig, metadata={
        "help": "Held-out evaluation every N steps during the run (greedy accuracy, pass@k), logged under eval/."})
    distributed: DistributedConfig = field(default_factory=DistributedConfig, metadata={
        "help": "Trainer ranks and their collectives."})
    stream: StreamReadConfig = field(default_factory=StreamReadConfig, metadata={
        "help": "Reading groups from the Redis stream."})
    linger_s: float = field(default=1.0, metadata={
        "help": "Seconds the status server keeps answering `finished` after the last step.", "ge": 0})
    after_finish: AfterFinish = field(default=AfterFinish.EXIT, metadata={
        "help": "After the last step: exit = exit 0 after linger_s; stay = keep serving status and health "
                "(finished) until SIGTERM, for workloads that restart whatever exits (a Kubernetes StatefulSet). "
                "Either way a trainer that resumes a checkpoint at total_steps trains nothing and pushes no "
                "weights."})
    threads: ThreadsConfig = field(default_factory=ThreadsConfig, metadata={
        "help": "Thread budget of this service (torch intra-op and inter-op threads; 0: automatic)."})
    http: HttpConfig = field(default_factory=lambda: http_config(8004), metadata={
        "help": "REST control plane (status, control calls, config), /healthz and /metrics."})
    server: ServerConfig = field(default_factory=lambda: server_config(50054), metadata={
        "help": "gRPC server of this service."})

    def validate(self) -> None:
        d = self.distributed
        replicate = d.dp_replicate or max(d.world_size // (d.dp_shard * d.tp * d.cp), 1)
        if replicate * d.dp_shard * d.tp * d.cp != d.world_size:
            raise ConfigError("distributed.world_size", d.world_size,
                              f"must equal dp_replicate ({replicate}) x dp_shard ({d.dp_shard}) x tp ({d.tp}) x cp "
                              f"({d.cp})")
        if self.groups_per_step % self.distributed.world_size:
            raise ConfigError("groups_per_step", self.groups_per_step,
                              f"must be divisible by distributed.world_size ({self.distributed.world_size})")
        if self.dynamic_sampling.enabled and self.loss.advantage is AdvantageEstimator.REINFORCE_PP:
            raise ConfigError("dynamic_sampling.enabled", True,
                              "needs a group baseline: with advantage reinforce_pp (batch baseline) a group of equal "
                              "rewards still carries advantage")
        distilling = self.loss.effective_policy_loss() is PolicyLoss.REVERSE_KL
        if distilling != bool(self.teacher.address):
            raise ConfigError("teacher.address", self.teacher.address,
                              "must be set exactly when loss.policy_loss is reverse_kl (the teacher's logprobs)")
        if self.micro_batch_layout is MicroBatchLayout.PACKED and self.micro_batch_tokens == 0:
            raise ConfigError("micro_batch_tokens", self.micro_batch_tokens,
                              "must be > 0 when micro_batch_layout is packed (the row budget)")
        if self.optimizer.warmup_steps > self.total_steps:
            raise ConfigError("optimizer.warmup_steps", self.optimizer.warmup_steps,
                              f"must be <= total_steps ({self.total_steps})")
