"""Configuration of the rollout service."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from relayrl.common.config import ConfigError
from relayrl.config.endpoints import HttpConfig, ServerConfig, http_config, server_config
from relayrl.config.threads import ThreadsConfig


@dataclass
class RolloutConfig:
    dataset: Path = field(default=Path("examples/data/arithmetic.jsonl"), metadata={
        "help": "JSONL prompts: one object per line with `prompt`, `answer`, optional `id`; other keys are "
                "passed to the reward function as metadata."})
    group_size: int = field(default=8, metadata={"help": "Samples per prompt (n); advantages are "
                                                 "normalised within a group.", "ge": 1})
    max_staleness: int = field(default=1, metadata={
        "help": "How many weight versions generation may run ahead of training (0: synchronous on-policy). "
                "Admission: groups admitted <= (max_staleness + trainer_step + 1) * groups_per_step.",
        "ge": 0})
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
    status_poll_s: float = field(default=0.2, metadata={
        "help": "Retry interval while the trainer is unreachable; poll interval against a trainer without WatchStatus.",
        "gt": 0})
    drain_timeout_s: float = field(default=5.0, metadata={
        "help": "At shutdown, how long groups in flight may finish before they are cancelled.", "ge": 0})
    max_group_attempts: int = field(default=3, metadata={
        "help": "Attempts per group before it is counted as failed and skipped.", "ge": 1})
    threads: ThreadsConfig = field(default_factory=ThreadsConfig, metadata={
        "help": "Thread budget of this service (torch intra-op and inter-op threads; 0: automatic)."})
    http: HttpConfig = field(default_factory=lambda: http_config(8003), metadata={
        "help": "REST control plane (status, control calls, config), /healthz and /metrics."})
    server: ServerConfig = field(default_factory=lambda: server_config(50053), metadata={
        "help": "gRPC server of this service."})

    def validate(self) -> None:
        if any(not s for s in self.stop):
            raise ConfigError("stop", self.stop, "stop strings must not be empty")
