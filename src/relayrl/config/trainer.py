"""Configuration of the trainer service.

Sections, in order of how often they are set: the run's length and batch at the top, then ``optimizer``,
``loss``, ``sft``, ``checkpoint``, ``publication`` (weights to inference), ``distributed`` (ranks), ``stream``
(reading groups from Redis), and the servers. The flat keys of schema 1 (``trainer.lr``,
``trainer.checkpoint_every``, ...) still load: ``MOVED_FIELDS`` maps each onto its nested field, with a warning
naming the new key (see :mod:`relayrl.config.typed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Literal, NamedTuple

from relayrl.config.distributed import DistributedConfig
from relayrl.config.endpoints import HttpConfig, ServerConfig, http_config, server_config
from relayrl.config.evaluation import InRunEvalConfig
from relayrl.config.loss import AdvantageEstimator, DynamicSamplingConfig, LossConfig, PolicyLoss, TeacherConfig
from relayrl.config.optimizer import OptimizerConfig
from relayrl.config.publication import PublicationConfig
from relayrl.config.threads import TrainerThreadsConfig
from relayrl.config.typed import ConfigError

FLAT_KEYS_REMOVED_IN = "0.3"  # the release that stops accepting the flat keys of MOVED_FIELDS


STOP_MARGIN = 1.5  # x the measured time of what a graceful trainer stop may still have to do


class StopBudget(NamedTuple):
    """How long a graceful trainer stop may take (``deadline_s``), what the measurements asked for (``need_s``)
    and which bound decided it."""

    deadline_s: float
    need_s: float
    bound: str


def graceful_stop_s(step_s: float, push_s: float, checkpoint_s: float, grace_s: float, max_s: float) -> StopBudget:
    """The trainer may finish the micro-batch it is in (at most a step), settle a push in flight and write a
    checkpoint, so a graceful stop may take STOP_MARGIN x (the longest step + push + checkpoint measured), at
    least ``grace_s`` (trainer.stop_grace_s) and at most ``max_s`` (trainer.stop_grace_max_s). The launcher waits
    this long before it kills the trainer; the trainer itself gives up its graceful stop after as long (so an
    orphaned trainer, whose launcher was killed, ends by itself)."""
    need = STOP_MARGIN * (step_s + push_s + checkpoint_s)
    bound = (
        "trainer.stop_grace_max_s"
        if need > max_s
        else "trainer.stop_grace_s"
        if grace_s >= need
        else "the measured steps"
    )
    return StopBudget(min(max(grace_s, need), max_s), need, bound)


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
class SftConfig:
    warmup_steps: int = field(
        default=0,
        metadata={
            "help": "Supervised steps on (prompt, answer) pairs of the rollout dataset before RL (0: none). They "
            "are logged with phase=sft and do not publish weight versions until the first RL step."
        },
    )
    batch_size: int = field(default=64, metadata={"help": "Rows per supervised warm-up step.", "ge": 1})


@dataclass
class CheckpointConfig:
    every: int = field(default=50, metadata={"help": "Save a checkpoint every N steps (0: only at the end).", "ge": 0})
    keep: int = field(default=2, metadata={"help": "Checkpoints kept on disk.", "ge": 1})
    resume: Literal["never", "auto"] = field(
        default="never",
        metadata={
            "help": "auto: restore the newest complete checkpoint under <output_dir>/checkpoints if there is one."
        },
    )


@dataclass
class StreamReadConfig:
    consumer: str = field(
        default="trainer",
        metadata={"help": "Redis consumer name prefix: rank r reads as <consumer>-rank<r> (stable across restarts)."},
    )
    read_block_ms: int = field(default=500, metadata={"help": "XREADGROUP block time.", "ge": 1})
    dead_letter_maxlen: int = field(
        default=10000,
        metadata={
            "help": "Entries kept (MAXLEN: the oldest go) in the dead-letter stream <redis.stream>:dead, where the "
            "trainer moves entries it cannot decode or validate (they are counted in episodes_invalid "
            "whatever this bound).",
            "ge": 1,
        },
    )


@dataclass
class TrainerConfig:
    # schema-1 flat key -> its field now (dotted, under trainer); each loads with a deprecation warning
    MOVED_FIELDS: ClassVar[dict[str, str]] = {
        **{k: f"optimizer.{k}" for k in ("lr", "weight_decay", "beta1", "beta2", "warmup_steps", "grad_clip")},
        **{
            k: f"loss.{k}"
            for k in ("clip_eps", "advantage", "off_policy", "importance_cap", "loss_aggregation", "advantage_eps")
        },
        "sft_warmup_steps": "sft.warmup_steps",
        "sft_batch_size": "sft.batch_size",
        "checkpoint_every": "checkpoint.every",
        "keep_checkpoints": "checkpoint.keep",
        "resume": "checkpoint.resume",
        "weight_transport": "publication.transport",
        "weight_chunk_bytes": "publication.chunk_bytes",
        "weight_push_timeout_s": "publication.push_timeout_s",
        **{k: f"publication.{k}" for k in ("probe_sequences", "probe_tokens", "probe_tolerance")},
        **{k: f"distributed.{k}" for k in ("world_size", "collective_timeout_s", "record_collectives")},
        "consumer": "stream.consumer",
        "read_block_ms": "stream.read_block_ms",
    }
    MOVED_REMOVED_IN: ClassVar[str] = FLAT_KEYS_REMOVED_IN

    total_steps: int = field(default=100, metadata={"help": "Optimizer steps to run, then stop.", "ge": 1})
    groups_per_step: int = field(
        default=8,
        metadata={
            "help": "Complete groups (prompts) per optimizer step: the batch is groups_per_step x group_size episodes.",
            "ge": 1,
        },
    )
    micro_batch_size: int = field(
        default=64,
        metadata={
            "help": "Sequences per forward/backward when micro_batch_tokens is 0 (sequences sorted by length, each "
            "micro-batch padded to its own longest).",
            "ge": 1,
        },
    )
    micro_batch_tokens: int = field(
        default=0,
        metadata={
            "help": "Token budget per forward/backward: sequences sorted by length fill a micro-batch while rows x "
            "its longest sequence stays within the budget (a longer sequence goes alone); 0: split by "
            "micro_batch_size. The loss does not depend on the split.",
            "ge": 0,
        },
    )
    micro_batch_layout: MicroBatchLayout = field(
        default=MicroBatchLayout.PADDED,
        metadata={
            "help": "padded: one sequence per row, each micro-batch padded to its longest; packed: sequences "
            "concatenated into one row of at most micro_batch_tokens positions (first-fit decreasing), "
            "attention kept within each sequence by its position ids (needs micro_batch_tokens > 0 and a "
            "model whose attention honours packed position ids, e.g. transformers' Qwen2/Llama with sdpa, "
            "eager or flash attention)."
        },
    )
    logprob_chunk_positions: int = field(
        default=256,
        metadata={
            "help": "The trainer's log-probabilities: > 0 runs the output layer only at the positions trained on "
            "(completion tokens, not prompt or padding) and the float32 log-softmax over the vocabulary this "
            "many positions at a time, so no [rows, length, vocab] float32 tensor is ever held (exact up to "
            "float rounding); 0: full logits of every position at once (the memory of the OOM in "
            "docs/models.md).",
            "ge": 0,
        },
    )
    optimizer: OptimizerConfig = field(
        default_factory=OptimizerConfig, metadata={"help": "AdamW and its learning-rate schedule."}
    )
    loss: LossConfig = field(
        default_factory=LossConfig, metadata={"help": "Advantages, the policy loss and its off-policy correction."}
    )
    on_reward_error: RewardErrorPolicy = field(
        default=RewardErrorPolicy.DROP,
        metadata={
            "help": "Episodes whose scoring failed (reward status ERROR or TIMEOUT): drop = exclude them from the "
            "loss and count them (episodes_dropped_reward_error); a group is trained on its valid episodes "
            "(advantages over those only) and dropped whole (groups_dropped_reward_error) when none is valid; "
            "fail = stop the trainer with an error naming the episode."
        },
    )
    dynamic_sampling: DynamicSamplingConfig = field(
        default_factory=DynamicSamplingConfig,
        metadata={"help": "Dropping (and counting) zero-advantage groups so a step trains on informative ones (DAPO)."},
    )
    teacher: TeacherConfig = field(
        default_factory=TeacherConfig,
        metadata={
            "help": "The teacher of on-policy distillation (policy_loss reverse_kl), reached over its inference "
            "endpoint."
        },
    )
    sft: SftConfig = field(default_factory=SftConfig, metadata={"help": "Supervised warm-up before RL."})
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig,
        metadata={"help": "Checkpoints under <output_dir>/checkpoints, and resuming from them."},
    )
    publication: PublicationConfig = field(
        default_factory=PublicationConfig,
        metadata={"help": "Publishing weight versions to inference and verifying them by the probe."},
    )
    eval: InRunEvalConfig = field(
        default_factory=InRunEvalConfig,
        metadata={
            "help": "Held-out evaluation every N steps during the run (greedy accuracy, pass@k), logged under eval/."
        },
    )
    distributed: DistributedConfig = field(
        default_factory=DistributedConfig, metadata={"help": "Trainer ranks and their collectives."}
    )
    stream: StreamReadConfig = field(
        default_factory=StreamReadConfig, metadata={"help": "Reading groups from the Redis stream."}
    )
    dump_episodes: int = field(
        default=0,
        metadata={
            "help": "Debugging: up to this many of every step's trained episodes (the groups' first episodes, then "
            "their second ones, ...) appended to <output_dir>/trained/episodes/rank<r>.jsonl, one protobuf "
            "JSON object (field names as in episode.proto, with the step) per line; 0: none.",
            "ge": 0,
        },
    )
    linger_s: float = field(
        default=1.0,
        metadata={"help": "Seconds the status server keeps answering `finished` after the last step.", "ge": 0},
    )
    stop_grace_s: float = field(
        default=30.0,
        metadata={
            "help": "A stop (SIGTERM/SIGINT) is graceful: the trainer stops at the next micro-batch boundary (the "
            "step's partial gradients discarded, its groups left pending and read again on resume) or read of groups, "
            "writes a final checkpoint and acknowledges the groups it holds; a second signal stops it at once. "
            "`relayrl run` waits for that at least this long, longer when the measured steps and checkpoints "
            "need it (about 1.5 x the longest step + push + checkpoint seen in metrics.jsonl), at most "
            "stop_grace_max_s, before it kills the trainer. Set a Kubernetes pod's "
            "terminationGracePeriodSeconds likewise.",
            "gt": 0,
        },
    )
    stop_grace_max_s: float = field(
        default=600.0,
        metadata={
            "help": "The most `relayrl run` waits for the trainer to stop gracefully, whatever its steps measured; "
            "then it is killed (its steps since the last checkpoint are trained again on resume).",
            "gt": 0,
        },
    )
    after_finish: AfterFinish = field(
        default=AfterFinish.EXIT,
        metadata={
            "help": "After the last step: exit = exit 0 after linger_s; stay = keep serving status and health "
            "(finished) until SIGTERM, for workloads that restart whatever exits (a Kubernetes StatefulSet). "
            "Either way a trainer that resumes a checkpoint at total_steps trains nothing and pushes no "
            "weights."
        },
    )
    threads: TrainerThreadsConfig = field(
        default_factory=TrainerThreadsConfig,
        metadata={
            "help": "Thread budget of this service (torch intra-op and inter-op threads; 0: automatic), and the "
            "cores it borrows while inference is idle."
        },
    )
    http: HttpConfig = field(
        default_factory=lambda: http_config(8004),
        metadata={"help": "REST control plane (status, control calls, config), /healthz and /metrics."},
    )
    server: ServerConfig = field(  # rollout's status stream and polls carry the control token: authenticated
        default_factory=lambda: server_config(50054, max_authenticated_rpcs=40),
        metadata={"help": "gRPC server of this service."},
    )

    def validate(self) -> None:
        d = self.distributed
        replicate = d.dp_replicate or max(d.world_size // (d.dp_shard * d.tp * d.cp), 1)
        if replicate * d.dp_shard * d.tp * d.cp != d.world_size:
            raise ConfigError(
                "distributed.world_size",
                d.world_size,
                f"must equal dp_replicate ({replicate}) x dp_shard ({d.dp_shard}) x tp ({d.tp}) x cp ({d.cp})",
            )
        if self.threads.borrow_cpus and d.world_size > 1:
            raise ConfigError(
                "threads.borrow_cpus", self.threads.borrow_cpus, "needs distributed.world_size 1 (one rank borrows)"
            )
        if self.groups_per_step % self.distributed.world_size:
            raise ConfigError(
                "groups_per_step",
                self.groups_per_step,
                f"must be divisible by distributed.world_size ({self.distributed.world_size})",
            )
        if self.dynamic_sampling.enabled and self.loss.advantage is AdvantageEstimator.REINFORCE_PP:
            raise ConfigError(
                "dynamic_sampling.enabled",
                True,
                "needs a group baseline: with advantage reinforce_pp (batch baseline) a group of equal "
                "rewards still carries advantage",
            )
        distilling = self.loss.effective_policy_loss() is PolicyLoss.REVERSE_KL
        if distilling != bool(self.teacher.address):
            raise ConfigError(
                "teacher.address",
                self.teacher.address,
                "must be set exactly when loss.policy_loss is reverse_kl (the teacher's logprobs)",
            )
        if self.micro_batch_layout is MicroBatchLayout.PACKED and self.micro_batch_tokens == 0:
            raise ConfigError(
                "micro_batch_tokens",
                self.micro_batch_tokens,
                "must be > 0 when micro_batch_layout is packed (the row budget)",
            )
        if self.stop_grace_max_s < self.stop_grace_s:
            raise ConfigError(
                "stop_grace_max_s", self.stop_grace_max_s, f"must be >= stop_grace_s ({self.stop_grace_s})"
            )
        if self.optimizer.warmup_steps > self.total_steps:
            raise ConfigError(
                "optimizer.warmup_steps", self.optimizer.warmup_steps, f"must be <= total_steps ({self.total_steps})"
            )
