"""How a weight version reaches inference: one small interface, one implementation per ``WeightTransport``.

- ``grpc_stream``: the tensors' bytes in chunks on the UpdateWeights client stream (relayrl.common.weights),
  then a manifest (version, count, bytes, SHA-256, probe).
- ``shared_path``: a safetensors file written atomically under ``<output_dir>/weights`` and a manifest naming it
  (with the same checksum); inference reads the file itself. For machines that share the output root (the
  local stack, one node); no ReadWriteMany volume is assumed anywhere else. The two newest files are kept.

The config enum (:class:`relayrl.config.trainer.WeightTransport`) names the choice; :func:`make_transport` picks
the implementation once, from :data:`TRANSPORTS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from relayrl.common.pb.inference_pb2 import WeightUpdateMessage
from relayrl.common.weights import iter_update_messages, manifest, write_shared
from relayrl.config.trainer import WeightTransport


class Transport(Protocol):
    """Turns a snapshot into the messages of one UpdateWeights call, and cleans up once a version is served."""

    def prepare(self, params: Mapping[str, torch.Tensor], version: int,
                probe: Sequence[Sequence[int]]) -> list[WeightUpdateMessage]:
        """The UpdateWeights stream for ``params`` as ``version`` (blocking: run it off the event loop)."""
        ...

    def after_success(self, version: int) -> None:
        """``version`` is served and verified: what older versions left behind may go."""
        ...


@dataclass(frozen=True)
class TransportSettings:
    chunk_bytes: int
    weights_dir: Path


class GrpcStreamTransport:
    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes

    def prepare(self, params: Mapping[str, torch.Tensor], version: int,
                probe: Sequence[Sequence[int]]) -> list[WeightUpdateMessage]:
        return list(iter_update_messages(params, version, self.chunk_bytes, probe))

    def after_success(self, version: int) -> None:
        pass  # nothing stays behind


class SharedPathTransport:
    def __init__(self, weights_dir: Path, keep: int = 2) -> None:
        self.weights_dir = weights_dir
        self.keep = keep

    def prepare(self, params: Mapping[str, torch.Tensor], version: int,
                probe: Sequence[Sequence[int]]) -> list[WeightUpdateMessage]:
        path = self.weights_dir / f"v{version:09d}.safetensors"
        write_shared(params, path)
        return [WeightUpdateMessage(manifest=manifest(params, version, probe, str(path.resolve())))]

    def after_success(self, version: int) -> None:
        files = sorted(self.weights_dir.glob("v*.safetensors"))
        for old in files[:-self.keep]:
            old.unlink(missing_ok=True)


TRANSPORTS: dict[WeightTransport, Callable[[TransportSettings], Transport]] = {
    WeightTransport.GRPC_STREAM: lambda s: GrpcStreamTransport(s.chunk_bytes),
    WeightTransport.SHARED_PATH: lambda s: SharedPathTransport(s.weights_dir),
}


def make_transport(kind: WeightTransport, chunk_bytes: int, weights_dir: Path) -> Transport:
    return TRANSPORTS[kind](TransportSettings(chunk_bytes, weights_dir))
