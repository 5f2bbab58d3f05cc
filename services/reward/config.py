"""Configuration of the reward service."""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.common.config import check_service_endpoint, client_target


@dataclass
class RewardConfig:
    function: str = field(default="relayrl.tasks.arithmetic:reward", metadata={
        "help": "Reward function as package.module:function (sync or async; see relayrl.reward.api)."})
    host: str = field(default="127.0.0.1", metadata={"help": "Address the gRPC server binds to."})
    port: int = field(default=50052, metadata={"help": "gRPC port (0: any free port)."})
    address: str = field(default="", metadata={
        "help": "host:port that clients use to reach this service; empty means host:port."})
    timeout_s: float = field(default=10.0, metadata={"help": "Per-call verifier timeout.", "gt": 0})
    max_workers: int = field(default=4, metadata={"help": "Verifier worker threads.", "ge": 1})
    max_batch: int = field(default=1024, metadata={"help": "Largest ScoreBatch accepted.", "ge": 1})
    shutdown_grace_s: float = field(default=5.0, metadata={"help": "Grace period for in-flight calls.", "ge": 0})

    def validate(self) -> None:
        check_service_endpoint(self.host, self.port)

    @property
    def target(self) -> str:
        return client_target(self.host, self.port, self.address)
