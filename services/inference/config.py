"""Configuration of the inference service."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from relayrl.common.grpc_utils import ServerConfig, server_config


class EngineKind(StrEnum):
    NATIVE = "native"


@dataclass
class InferenceConfig:
    engine: EngineKind = field(default=EngineKind.NATIVE, metadata={"help": "Generation engine."})
    max_batch_sequences: int = field(default=128, metadata={
        "help": "Most sequences (prompts x n) decoded together in one batch.", "ge": 1})
    batch_wait_ms: float = field(default=2.0, metadata={
        "help": "How long the batcher waits for more requests before starting a batch.", "ge": 0})
    max_prompt_tokens: int = field(default=2048, metadata={"help": "Longest accepted prompt.", "ge": 1})
    max_new_tokens_limit: int = field(default=2048, metadata={
        "help": "Largest max_new_tokens a request may ask for.", "ge": 1})
    max_samples_per_request: int = field(default=256, metadata={"help": "Largest n per request.", "ge": 1})
    server: ServerConfig = field(default_factory=lambda: server_config(50051), metadata={
        "help": "gRPC server of this service."})
