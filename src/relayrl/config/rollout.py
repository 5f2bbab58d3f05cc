"""Configuration of the rollout service."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from relayrl.config.agents import AgentConfig
from relayrl.config.dataset import BadRows, DatasetFields, DatasetFormat, DatasetSpec
from relayrl.config.endpoints import HttpConfig, ServerConfig, http_config, server_config
from relayrl.config.threads import ThreadsConfig
from relayrl.config.typed import ConfigError

# The built-in workflows (relayrl.rollout.workflows); any other value of rollout.workflow is a user workflow.
BUILTIN_WORKFLOWS = ("single_turn", "multi_turn", "tools", "agent")


class ToolFormat(StrEnum):
    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5, SmolLM2/3, Hermes)
    TAGGED = "tagged"  # <name>argument text</name>: a plain format a tiny character-level model can learn


@dataclass
class RolloutConfig:
    dataset: Path = field(
        default=Path("examples/data/arithmetic.jsonl"),
        metadata={
            "help": "The prompts: a JSONL, Parquet or Arrow file, a folder written by `datasets`' save_to_disk, or a "
            "folder of such files (shards, read in name order). Each row has a prompt (or a conversation) and an "
            "answer, under the names rollout.fields gives; its other fields reach the reward function as metadata. "
            "Read row by row, never whole."
        },
    )
    dataset_format: DatasetFormat = field(
        default=DatasetFormat.AUTO,
        metadata={"help": "The dataset's format; auto: by the file's suffix or the folder's contents."},
    )
    fields: DatasetFields = field(
        default_factory=DatasetFields,
        metadata={"help": "Which fields of a row hold the prompt, the conversation, the answer and the id."},
    )
    bad_rows: BadRows = field(
        default=BadRows.ERROR,
        metadata={
            "help": "A row that cannot be read (not an object, no prompt or answer, a malformed conversation): error "
            "stops at start-up naming the file, row and field; skip leaves it out and counts it."
        },
    )
    held_out_rows: int = field(
        default=0,
        metadata={
            "help": "Rows held out of training (a seeded choice, rollout.seed): the in-run evaluation scores them when "
            "trainer.eval.dataset is not set, and `relayrl eval` when no --dataset is given.",
            "ge": 0,
        },
    )
    group_size: int = field(
        default=8, metadata={"help": "Samples per prompt (n); advantages are normalised within a group.", "ge": 1}
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "How many weight versions generation may run ahead of training (0: synchronous on-policy). "
            "Admission: groups admitted <= (max_staleness + trainer_step + 1) * groups_per_step.",
            "ge": 0,
        },
    )
    max_concurrent_groups: int = field(default=8, metadata={"help": "Groups generated at once.", "ge": 1})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature.", "gt": 0})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass.", "gt": 0, "le": 1})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (0: off).", "ge": 0})
    max_new_tokens: int = field(default=8, metadata={"help": "Tokens generated per sample at most.", "ge": 1})
    stop: list[str] = field(default_factory=list, metadata={"help": "Stop strings."})
    shuffle: bool = field(default=True, metadata={"help": "Shuffle the dataset every epoch."})
    seed: int = field(default=0, metadata={"help": "Seed of the dataset order."})
    producer_id: str = field(default="", metadata={"help": "Id stamped on episodes; empty: host:pid."})
    generate_timeout_s: float = field(default=120.0, metadata={"help": "Deadline of one Generate call.", "gt": 0})
    score_timeout_s: float = field(default=60.0, metadata={"help": "Deadline of one ScoreBatch call.", "gt": 0})
    status_poll_s: float = field(
        default=0.2,
        metadata={
            "help": "Retry interval while the trainer is unreachable; poll interval against a trainer without "
            "WatchStatus.",
            "gt": 0,
        },
    )
    drain_timeout_s: float = field(
        default=5.0,
        metadata={"help": "At shutdown, how long groups in flight may finish before they are cancelled.", "ge": 0},
    )
    max_group_attempts: int = field(
        default=3, metadata={"help": "Attempts per group before it is counted as failed and skipped.", "ge": 1}
    )
    score_batch_max: int = field(
        default=1024,
        metadata={
            "help": "Concurrent groups' ScoreBatch calls are joined into one call of at most this many requests (and "
            "at most reward.max_batch; relayrl.rollout.joining); 0: one call per group.",
            "ge": 0,
        },
    )
    generate_batch_max: int = field(
        default=64,
        metadata={
            "help": "Concurrent Generate calls are joined into one GenerateBatch call of at most this many requests "
            "(relayrl.rollout.joining); 0: one Generate per call.",
            "ge": 0,
        },
    )
    generate_calls_in_flight: int = field(
        default=1,
        metadata={
            "help": "Joined generation calls on the wire at once, per inference replica. Each caller gets its answer "
            "as soon as its samples end (GenerateBatchStream), but a group admitted meanwhile waits for a call "
            "to end before its own goes out: more calls in flight keep a continuously batching engine fuller "
            "when sample lengths vary widely (bench/scale_sim.py), at the price of more calls, and of the "
            "trainer seeing the groups that finish first first.",
            "ge": 1,
            "le": 8,
        },
    )
    workflow: str = field(
        default="single_turn",
        metadata={
            "help": "How a dataset row becomes a group of episodes: single_turn (one completion per episode, scored by "
            "the reward service), multi_turn (an environment over several turns: rollout.environment), tools "
            "(the model calls rollout.tools and answers; the answer is scored by the reward service), agent (a "
            "black-box agent program talks to the model through an OpenAI-compatible endpoint: rollout.agent), "
            "or a user "
            "workflow as package.module:function or an entry point of group relayrl.workflows."
        },
    )
    environment: str = field(
        default="",
        metadata={
            "help": "multi_turn: the environment factory (package.module:function, or an entry point of group "
            "relayrl.environments) that builds one environment per episode from its dataset row."
        },
    )
    tools: list[str] = field(
        default_factory=list,
        metadata={
            "help": "tools: the tool functions (package.module:function each), called by name; a tool's JSON schema is "
            "its `schema` attribute or is built from its signature."
        },
    )
    tool_format: ToolFormat = field(
        default=ToolFormat.HERMES,
        metadata={
            "help": "How the model writes a tool call: hermes (<tool_call> JSON, the chat templates' convention) or "
            "tagged (<name>argument</name>, for tiny models)."
        },
    )
    tool_timeout_s: float = field(
        default=10.0,
        metadata={"help": "Deadline of one tool call; a call past it is a tool error shown to the model.", "gt": 0},
    )
    max_turns: int = field(
        default=4, metadata={"help": "Multi-turn: model turns per episode at most (finish reason max_turns).", "ge": 1}
    )
    max_episode_tokens: int = field(
        default=256,
        metadata={
            "help": "Multi-turn: tokens after the prompt per episode at most, model and observation tokens together "
            "(finish reason max_tokens); the trainer's cap on an episode's length. Each turn samples at most "
            "rollout.max_new_tokens of them.",
            "ge": 1,
        },
    )
    max_tool_calls: int = field(
        default=8,
        metadata={"help": "Multi-turn: tool calls per episode at most (finish reason max_tool_calls).", "ge": 0},
    )
    episode_timeout_s: float = field(
        default=300.0,
        metadata={"help": "Multi-turn: wall time of one episode at most (finish reason timeout).", "gt": 0},
    )
    agent: AgentConfig = field(
        default_factory=AgentConfig,
        metadata={
            "help": "agent: the black-box agent function and its OpenAI-compatible session endpoint (docs/agents.md)."
        },
    )
    threads: ThreadsConfig = field(
        default_factory=ThreadsConfig,
        metadata={"help": "Thread budget of this service (torch intra-op and inter-op threads; 0: automatic)."},
    )
    http: HttpConfig = field(
        default_factory=lambda: http_config(8003),
        metadata={"help": "REST control plane (status, control calls, config), /healthz and /metrics."},
    )
    server: ServerConfig = field(
        default_factory=lambda: server_config(50053), metadata={"help": "gRPC server of this service."}
    )

    def validate(self) -> None:
        if any(not s for s in self.stop):
            raise ConfigError("stop", self.stop, "stop strings must not be empty")
        if not self.workflow.strip():
            raise ConfigError(
                "workflow",
                self.workflow,
                f"must be one of {', '.join(BUILTIN_WORKFLOWS)}, package.module:function or a registered workflow",
            )
        if self.workflow == "multi_turn" and not self.environment:
            raise ConfigError("environment", self.environment, "the multi_turn workflow needs an environment")
        if self.workflow == "agent" and not self.agent.function:
            raise ConfigError("agent.function", self.agent.function, "the agent workflow needs an agent function")
        if self.workflow == "tools" and not self.tools:
            raise ConfigError("tools", self.tools, "the tools workflow needs at least one tool")
        if self.multi_turn and self.max_episode_tokens < self.max_new_tokens:
            raise ConfigError(
                "max_episode_tokens",
                self.max_episode_tokens,
                f"must be at least max_new_tokens ({self.max_new_tokens})",
            )

    def dataset_spec(self, path: Path | None = None, field_name: str = "rollout.dataset") -> DatasetSpec:
        """How to read ``path`` (default: the dataset) with this section's format, fields and bad-row rule."""
        return DatasetSpec(
            path if path is not None else self.dataset,
            self.dataset_format,
            self.fields,
            self.bad_rows,
            self.held_out_rows if path is None else 0,
            self.seed,
            field_name,
        )

    @property
    def multi_turn(self) -> bool:
        """Whether episodes may hold several turns (any workflow but single_turn)."""
        return self.workflow != "single_turn"

    def episode_token_cap(self) -> int:
        """The most tokens after the prompt an episode may hold: the trainer's validation cap."""
        return self.max_episode_tokens if self.multi_turn else self.max_new_tokens
