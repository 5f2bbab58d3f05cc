"""How a weight version reaches inference: one small interface, one implementation per ``WeightTransport``.

- ``grpc_stream``: the tensors' bytes in chunks on the UpdateWeights client stream (relayrl.common.weights),
  then a manifest (version, count, bytes, SHA-256, probe).
- ``shared_path``: a safetensors file written atomically under ``<output_dir>/weights`` and a manifest naming it
  (with the same checksum); inference reads the file itself. For machines that share the output root (the
  local stack, one node); no ReadWriteMany volume is assumed anywhere else. The two newest files are kept.
- ``shared_memory``: same host only. The tensors are written once into a file under the same directory (0600, no
  fsync: page cache) and hashed in the same pass with XXH3-128 (the manifest names the algorithm; an integrity
  check: only the trainer's own user can write the file); inference copies them out; the file goes once served.

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
from relayrl.common.weights import iter_update_messages, manifest, write_mapped, write_shared
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
        files = sorted(self.weights_dir.glob("v" + "[0-9]" * 9 + ".safetensors"))
        for old in files[:-self.keep]:
            old.unlink(missing_ok=True)


class SharedMemoryTransport:
    """Same host only: one file per version under the weights directory, written once (0600, no fsync) and hashed
    in the same pass (XXH3-128); only the manifest travels over gRPC. Inference copies the tensors out of the file
    and checks them against the manifest's checksum. A version's file goes as soon as it (or a newer one) is
    served, and whatever an earlier run left behind goes when the transport is made."""

    PATTERN = "v*.shm.safetensors"

    def __init__(self, weights_dir: Path) -> None:
        self.weights_dir = weights_dir
        self._swept = False  # leftovers are removed at the first push (rank 0 only pushes)

    def _sweep(self) -> None:
        self.weights_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for old in [*self.weights_dir.glob(self.PATTERN), *self.weights_dir.glob(self.PATTERN + ".tmp")]:
            old.unlink(missing_ok=True)
        self._swept = True

    def path(self, version: int) -> Path:
        return self.weights_dir / f"v{version:09d}.shm.safetensors"

    def prepare(self, params: Mapping[str, torch.Tensor], version: int,
                probe: Sequence[Sequence[int]]) -> list[WeightUpdateMessage]:
        if not self._swept:
            self._sweep()
        return [WeightUpdateMessage(manifest=write_mapped(params, version, probe, self.path(version)))]

    def after_success(self, version: int) -> None:
        for old in self.weights_dir.glob(self.PATTERN):
            if old.name <= self.path(version).name:  # zero-padded versions: names sort like versions
                old.unlink(missing_ok=True)


TRANSPORTS: dict[WeightTransport, Callable[[TransportSettings], Transport]] = {
    WeightTransport.GRPC_STREAM: lambda s: GrpcStreamTransport(s.chunk_bytes),
    WeightTransport.SHARED_PATH: lambda s: SharedPathTransport(s.weights_dir),
    WeightTransport.SHARED_MEMORY: lambda s: SharedMemoryTransport(s.weights_dir),
}


def resolve_transport(kind: WeightTransport) -> WeightTransport:
    """``auto`` left unresolved (a service started on its own, which cannot know that inference shares its
    filesystem) is ``grpc_stream``; ``relayrl run`` resolves it to ``shared_memory`` before it starts the services
    (relayrl.launcher). Any other choice stands."""
    return WeightTransport.GRPC_STREAM if kind is WeightTransport.AUTO else kind


def make_transport(kind: WeightTransport, chunk_bytes: int, weights_dir: Path) -> Transport:
    return TRANSPORTS[resolve_transport(kind)](TransportSettings(chunk_bytes, weights_dir))
