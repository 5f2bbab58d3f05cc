"""Configuration of weight publication (``trainer.publication``): how the trainer's weights reach inference, and
how each swap is verified. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from relayrl.config.typed import ConfigError

DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024  # bytes per weight-update chunk: well under gRPC's default 4 MiB message limit


class CollectiveBackend(StrEnum):
    GLOO = "gloo"  # CPU tensors
    NCCL = "nccl"  # CUDA tensors


class WeightTransport(StrEnum):
    """The config's choice of transport; the implementations are relayrl.trainer.transports.Transport."""

    GRPC_STREAM = "grpc_stream"
    SHARED_PATH = "shared_path"
    SHARED_MEMORY = "shared_memory"  # same host: a file in the weights directory, page cache, only the manifest on gRPC
    COLLECTIVE = (
        "collective"  # torch.distributed broadcast to every replica at once (relayrl.common.collective_weights)
    )
    AUTO = "auto"  # shared_memory under `relayrl run` (one host, one output folder), else grpc_stream


@dataclass
class PublicationConfig:
    transport: WeightTransport = field(
        default=WeightTransport.AUTO,
        metadata={
            "help": "How weights reach inference: grpc_stream (chunks on the UpdateWeights stream), shared_path "
            "(a safetensors file under <output_dir>/weights that inference reads; needs a shared "
            "filesystem), shared_memory (same host: a file in that folder written once without fsync, removed "
            "once served; only the manifest on gRPC), collective (a torch.distributed broadcast to every replica "
            "at once: see collective_address) or auto (shared_memory under `relayrl run`, where every "
            "service runs on one host with one output folder; grpc_stream for services started on their "
            "own)."
        },
    )
    collective_address: str = field(
        default="127.0.0.1:0",
        metadata={
            "help": "transport collective: host:port of the trainer's TCPStore, where each update's group meets. "
            "The trainer listens on the port (0: a free one) and each replica dials the host, so it must be "
            "the trainer pod's name on a cluster (the default serves one host).",
        },
    )
    collective_backend: CollectiveBackend = field(
        default=CollectiveBackend.GLOO,
        metadata={"help": "transport collective: gloo (CPU tensors) or nccl (CUDA tensors on both ends)."},
    )
    collective_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "transport collective: how long the trainer waits for the replicas of an update to join (a "
            "replica not ready by then misses this update and is behind), and each step of the broadcast may "
            "take.",
            "gt": 0,
        },
    )
    chunk_bytes: int = field(
        default=DEFAULT_CHUNK_BYTES,
        metadata={
            "help": "Bytes per weight-update chunk (under gRPC's 4 MiB message limit).",
            "ge": 1024,
            "le": 4 * 1024 * 1024 - 4096,
        },
    )
    push_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "Deadline of one weight push to inference, its retries included (while inference restarts or "
            "its weights server is busy) and a final check of whether it landed.",
            "gt": 0,
        },
    )
    probe_sequences: int = field(
        default=4,
        metadata={
            "help": "Sequences of the probe batch inference scores after a weight swap when a probe is due (see "
            "probe_every).",
            "ge": 1,
        },
    )
    probe_tokens: int = field(
        default=16,
        metadata={
            "help": "Tokens per probe sequence (16 x 4 sequences: every layer and 64 vocabulary rows take part; a "
            "reload that leaves a layer behind moves every logprob).",
            "ge": 2,
        },
    )
    probe_every: int = field(
        default=10,
        metadata={
            "help": "Score the probe on the first publication, then on every N-th (0: never again). Every publication "
            "is verified exactly in any case where the engine can (native): the checksum of the bytes sent "
            "matches what inference received, and every module path of every updated parameter (tied "
            "aliases included) reads those very tensors after the swap. The probe adds an end-to-end "
            "check of the forward pass (logprob parity), at the cost of a forward pass on each side; an "
            "engine that cannot confirm the served weights (vLLM) is probed on every publication.",
            "ge": 0,
        },
    )
    overlap: bool = field(
        default=True,
        metadata={
            "help": "Push each step's weights in the background while the trainer reads and trains its next batch "
            "(the version is allocated before the push, so staleness stays exact; the push is awaited before "
            "the next publication and every checkpoint). false: the step waits for its push."
        },
    )
    probe_tolerance: float = field(
        default=0.0,
        metadata={
            "help": "Largest accepted |logprob difference| between trainer and inference on the probe (0: by dtype: "
            "float32 1e-3, float16 2e-2, bfloat16 1e-1). Above it the trainer stops.",
            "ge": 0,
        },
    )
    inference_wait_s: float = field(
        default=600.0,
        metadata={
            "help": "How long the first publication waits for inference to answer at all (it may still be loading its "
            "model: minutes for a large model or for vLLM) before the trainer gives up.",
            "ge": 0,
        },
    )

    def validate(self) -> None:
        host, _, port = self.collective_address.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError("collective_address", self.collective_address, "must be host:port (port 0: a free one)")
