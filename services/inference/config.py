"""Configuration of the inference service."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from relayrl.common.config import check_service_endpoint, client_target


class EngineKind(StrEnum):
    NATIVE = "native"


@dataclass
class InferenceConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "Address the gRPC server binds to."})
    port: int = field(default=50051, metadata={"help": "gRPC port (0: any free port)."})
    address: str = field(default="", metadata={
        "help": "host:port that clients use to reach this service; empty means host:port."})
    engine: EngineKind = field(default=EngineKind.NATIVE, metadata={"help": "Generation engine."})
    max_batch_sequences: int = field(default=128, metadata={
        "help": "Most sequences (prompts x n) decoded together in one batch.", "ge": 1})
    batch_wait_ms: float = field(default=2.0, metadata={
        "help": "How long the batcher waits for more requests before starting a batch.", "ge": 0})
    max_prompt_tokens: int = field(default=2048, metadata={"help": "Longest accepted prompt.", "ge": 1})
    max_new_tokens_limit: int = field(default=2048, metadata={
        "help": "Largest max_new_tokens a request may ask for.", "ge": 1})
    max_samples_per_request: int = field(default=256, metadata={"help": "Largest n per request.", "ge": 1})
    shutdown_grace_s: float = field(default=5.0, metadata={"help": "Grace period for in-flight calls.", "ge": 0})

    def validate(self) -> None:
        check_service_endpoint(self.host, self.port)

    @property
    def target(self) -> str:
        return client_target(self.host, self.port, self.address)
