"""Configuration of the reward service."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from relayrl.common.config import ConfigError
from relayrl.common.grpc_utils import ServerConfig, server_config
from relayrl.common.http import HttpConfig, http_config
from relayrl.reward.sandbox import SandboxConfig


@dataclass
class ComponentConfig:
    """One named, weighted part of a composite reward."""

    name: str = field(metadata={"help": "Name the component's score is reported under."})
    function: str = field(metadata={
        "help": "package.module:function or a registered reward name (math, exact_match, regex, format, code, "
                "arithmetic, or a plugin's entry point in group relayrl.rewards)."})
    weight: float = field(default=1.0, metadata={"help": "Weight of this component in the total."})
    params: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "Keyword arguments passed to the function after the input: fn(inp, **params)."})

    def validate(self) -> None:
        if not self.name:
            raise ConfigError("name", self.name, "must not be empty")
        if not math.isfinite(self.weight):
            raise ConfigError("weight", self.weight, "must be finite")


def _default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass
class RewardConfig:
    function: str = field(default="relayrl.tasks.arithmetic:reward", metadata={
        "help": "Reward function as package.module:function or a registered reward name (sync or async; see "
                "relayrl.reward.api). Ignored when `components` is set."})
    params: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "Keyword arguments for `function`: fn(inp, **params)."})
    components: list[ComponentConfig] = field(default_factory=list, metadata={
        "help": "Composite reward: total = sum of weight x score over these; each score is reported by name."})
    timeout_s: float = field(default=10.0, metadata={
        "help": "Per-call verifier timeout: the worker that overruns is killed and replaced, and the call is a "
                "TIMEOUT result.", "gt": 0})
    workers: int = field(default_factory=_default_workers, metadata={
        "help": "Verifier worker processes (default: CPU count, at most 4).", "ge": 1})
    chunk_size: int = field(default=32, metadata={
        "help": "Most requests sent to one worker at once (a batch is split across the workers).", "ge": 1})
    worker_memory_mb: int = field(default=4096, metadata={
        "help": "RLIMIT_AS of each verifier worker process in MiB (0: unlimited); a verifier that allocates more "
                "gets MemoryError, which is an error result.", "ge": 0})
    start_method: Literal["forkserver", "spawn"] = field(default="forkserver", metadata={
        "help": "How worker processes start: forkserver (fast replacement; modules preloaded) or spawn."})
    max_batch: int = field(default=1024, metadata={"help": "Largest ScoreBatch accepted.", "ge": 1})
    max_workers: int = field(default=0, metadata={
        "help": "Former number of verifier threads; when set (> 0) it is used as `workers`.", "ge": 0,
        "deprecated": "use workers (verifiers now run in worker processes)", "removed_in": "0.3"})
    sandbox: SandboxConfig = field(default_factory=SandboxConfig, metadata={
        "help": "The sandbox that runs model-written code (the `code` verifier)."})
    http: HttpConfig = field(default_factory=lambda: http_config(8002), metadata={
        "help": "REST API (POST /score), /healthz and /metrics."})
    server: ServerConfig = field(default_factory=lambda: server_config(50052), metadata={
        "help": "gRPC server of this service."})

    def validate(self) -> None:
        if self.max_workers:
            self.workers = self.max_workers  # the deprecated spelling still takes effect
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ConfigError("components", names, "component names must be unique")
        if self.timeout_s < self.sandbox.total_timeout_s + 1:
            raise ConfigError("timeout_s", self.timeout_s,
                              f"must be >= sandbox.total_timeout_s + 1 ({self.sandbox.total_timeout_s + 1}): "
                              "a code verification must finish before its call times out")
