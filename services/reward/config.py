"""Configuration of the reward service."""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.common.grpc_utils import ServerConfig, server_config


@dataclass
class RewardConfig:
    function: str = field(default="relayrl.tasks.arithmetic:reward", metadata={
        "help": "Reward function as package.module:function (sync or async; see relayrl.reward.api)."})
    timeout_s: float = field(default=10.0, metadata={"help": "Per-call verifier timeout.", "gt": 0})
    max_workers: int = field(default=4, metadata={"help": "Verifier worker threads.", "ge": 1})
    max_batch: int = field(default=1024, metadata={"help": "Largest ScoreBatch accepted.", "ge": 1})
    server: ServerConfig = field(default_factory=lambda: server_config(50052), metadata={
        "help": "gRPC server of this service."})
