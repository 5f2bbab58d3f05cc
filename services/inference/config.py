"""Configuration of the inference service."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from relayrl.common.grpc_utils import ServerConfig, server_config


class EngineKind(StrEnum):
    NATIVE = "native"


class KvOnUpdate(StrEnum):
    """What happens to the KV cache of sequences in flight when weights are swapped."""

    RECOMPUTE = "recompute"  # rebuild it under the new weights before the next decode step (exact)
    KEEP = "keep"  # keep using keys/values computed by the old weights (faster, mixes policies)


@dataclass
class InferenceConfig:
    engine: EngineKind = field(default=EngineKind.NATIVE, metadata={"help": "Generation engine."})
    kv_on_update: KvOnUpdate = field(default=KvOnUpdate.RECOMPUTE, metadata={
        "help": "KV cache of in-flight sequences after a weight swap: recompute (under the new weights) or keep. "
                "No prefix cache is shared across requests, so no entry computed under other weights is reused."})
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
