"""How a weight version reaches inference: one small interface, one implementation per ``WeightTransport``.

- ``grpc_stream``: the tensors' bytes in chunks on the UpdateWeights client stream (relayrl.common.weights),
  then a manifest (version, count, bytes, SHA-256, probe).
- ``shared_path``: a safetensors file written atomically under ``<output_dir>/weights`` and a manifest naming it
  (with the same checksum); inference reads the file itself. For machines that share the output root (the
  local stack, one node); no ReadWriteMany volume is assumed anywhere else. The two newest files are kept.
- ``shared_memory``: same host only. The tensors are written once into a file under the same directory (0600, no
  fsync: page cache) and hashed in the same pass with XXH3-128 (the manifest names the algorithm; an integrity
  check: only the trainer's own user can write the file); inference copies them out; the file goes once served.

A sharded publication (FSDP2) hands every transport a :class:`~relayrl.trainer.weight_files.MappedWeights` instead
of a snapshot in memory: the file its gather wrote into the transport's spool (:meth:`Transport.spool_path`), one
tensor at a time, hashed in the same pass by the transport's :attr:`Transport.checksum_algorithm` (XXH3-128 for
``shared_memory``, SHA-256 for the others). ``shared_memory`` and ``shared_path`` then give that file its versioned
name (a hard link: no second write); ``grpc_stream`` reads its chunks from it as they are sent.

- ``collective``: only the manifest travels on each replica's UpdateWeights call, with the join of a
  ``torch.distributed`` group formed for this update (relayrl.common.collective_weights); the tensors go to every
  replica at once by broadcast, one at a time, in name order.

A transport hands the publisher a :class:`Delivery` per push: the messages each replica's call carries, and what
runs beside the calls (the broadcast; nothing for the others).

The config enum (:class:`relayrl.config.publication.WeightTransport`) names the choice; :func:`make_transport` picks
the implementation once, from :data:`TRANSPORTS`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeAlias

import torch

from relayrl.common.collective_weights import CollectiveHost, CollectiveSession, layout_digest
from relayrl.common.pb.inference_pb2 import (
    CHECKSUM_ALGORITHM_SHA256,
    CHECKSUM_ALGORITHM_XXH3_128,
    WeightUpdateMessage,
)
from relayrl.common.weights import dtype_name, iter_update_messages, manifest, write_shared
from relayrl.config.publication import PublicationConfig, WeightTransport
from relayrl.trainer.weight_files import FileUpdateMessages, MappedWeights, write_mapped

# a snapshot in memory, or the file a sharded gather wrote
Weights: TypeAlias = Mapping[str, torch.Tensor] | MappedWeights


class Delivery(Protocol):
    """One push to ``n`` replicas: replica ``i``'s messages, and the work beside the calls."""

    def messages(self, i: int) -> Sequence[WeightUpdateMessage]: ...

    def run(self, failed: Callable[[int], bool]) -> int:
        """Blocking, beside the calls (``failed(i)``: replica ``i``'s call ended in an error): bytes sent."""
        ...


@dataclass(frozen=True)
class PointToPoint:
    """Every replica's call carries the same messages; nothing runs beside."""

    all_messages: Sequence[WeightUpdateMessage]

    def messages(self, i: int) -> Sequence[WeightUpdateMessage]:
        return self.all_messages

    def run(self, failed: Callable[[int], bool]) -> int:
        return 0


class Transport(Protocol):
    """Turns a snapshot into the messages of one UpdateWeights call, and cleans up once a version is served."""

    # the manifests' checksum_algorithm; a sharded gather hashes its spool file by it
    checksum_algorithm: int

    def prepare(self, params: Weights, version: int, probe: Sequence[Sequence[int]]) -> Sequence[WeightUpdateMessage]:
        """The UpdateWeights stream for ``params`` as ``version`` (blocking: run it off the event loop)."""
        ...

    def spool_path(self) -> Path:
        """A fresh file name under the weights directory for a sharded gather to write into."""
        ...

    def deliver(self, params: Weights, messages: Sequence[WeightUpdateMessage], n: int) -> Delivery:
        """How the prepared ``messages`` reach ``n`` replicas."""
        ...

    def after_success(self, version: int) -> None:
        """``version`` is served and verified: what older versions left behind may go."""
        ...


# once one replica answered a push (or joined a broadcast), the others get max(LAGGARD_MIN_S, LAGGARD_FACTOR x its
# time) more, then count as behind: a dead replica never holds a publication up for longer
LAGGARD_MIN_S = 5.0
LAGGARD_FACTOR = 3.0


def laggard_grace_s(first_s: float) -> float:
    return max(LAGGARD_MIN_S, LAGGARD_FACTOR * first_s)


@dataclass(frozen=True)
class TransportSettings:
    chunk_bytes: int
    weights_dir: Path
    collective: CollectiveHost | None = None  # the collective transport's store (trainer.publication.collective_*)
    device: torch.device | None = None  # where the collective transport's broadcast buffers live (None: the CPU)


class Spool:
    """Names for the files sharded gathers write (``gather-<n>.safetensors``), in a directory created 0700; what an
    earlier run left there goes at the first name."""

    PATTERN = "gather-*.safetensors"

    def __init__(self, weights_dir: Path) -> None:
        self.weights_dir = weights_dir
        self._swept = False
        self._count = itertools.count(1)

    def path(self) -> Path:
        if not self._swept:
            self.weights_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            for old in [*self.weights_dir.glob(self.PATTERN), *self.weights_dir.glob(self.PATTERN + ".tmp")]:
                old.unlink(missing_ok=True)
            self._swept = True
        return self.weights_dir / f"gather-{next(self._count):09d}.safetensors"


class GrpcStreamTransport:
    """A snapshot in memory is cut into chunks at once (all of them held until sent); a sharded gather's file is
    read one chunk at a time as the stream is sent (only the spool needs the weights directory)."""

    checksum_algorithm = CHECKSUM_ALGORITHM_SHA256  # the bytes may cross a network

    def __init__(self, chunk_bytes: int, weights_dir: Path | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.spool = Spool(weights_dir) if weights_dir is not None else None

    def prepare(self, params: Weights, version: int, probe: Sequence[Sequence[int]]) -> Sequence[WeightUpdateMessage]:
        if isinstance(params, MappedWeights):
            _check_algorithm(params, self.checksum_algorithm)
            return FileUpdateMessages(params, version, self.chunk_bytes, probe)
        return list(iter_update_messages(params, version, self.chunk_bytes, probe))

    def spool_path(self) -> Path:
        if self.spool is None:
            raise RuntimeError("a sharded publication over grpc_stream needs a weights directory to spool into")
        return self.spool.path()

    def deliver(self, params: Weights, messages: Sequence[WeightUpdateMessage], n: int) -> Delivery:
        return PointToPoint(messages)

    def after_success(self, version: int) -> None:
        pass  # nothing stays behind


class SharedPathTransport:
    checksum_algorithm = CHECKSUM_ALGORITHM_SHA256  # the file may lie on storage others can write

    def __init__(self, weights_dir: Path, keep: int = 2) -> None:
        self.weights_dir = weights_dir
        self.keep = keep
        self.spool = Spool(weights_dir)

    def prepare(self, params: Weights, version: int, probe: Sequence[Sequence[int]]) -> list[WeightUpdateMessage]:
        path = self.weights_dir / f"v{version:09d}.safetensors"
        if isinstance(params, MappedWeights):  # the gather wrote it: on disk (fsync), then under the version's name
            _check_algorithm(params, self.checksum_algorithm)
            params.fsync()
            params.link(path)
            return [WeightUpdateMessage(manifest=params.manifest(version, probe, path))]
        write_shared(params, path)
        return [WeightUpdateMessage(manifest=manifest(params, version, probe, str(path.resolve())))]

    def spool_path(self) -> Path:
        return self.spool.path()

    def deliver(self, params: Weights, messages: Sequence[WeightUpdateMessage], n: int) -> Delivery:
        return PointToPoint(messages)

    def after_success(self, version: int) -> None:
        files = sorted(self.weights_dir.glob("v" + "[0-9]" * 9 + ".safetensors"))
        for old in files[: -self.keep]:
            old.unlink(missing_ok=True)


class SharedMemoryTransport:
    """Same host only: one file per version under the weights directory, written once (0600, no fsync) and hashed
    in the same pass (XXH3-128); only the manifest travels over gRPC. Inference copies the tensors out of the file
    and checks them against the manifest's checksum. A version's file goes as soon as it (or a newer one) is
    served, and whatever an earlier run left behind goes when the transport is made."""

    PATTERN = "v*.shm.safetensors"
    checksum_algorithm = CHECKSUM_ALGORITHM_XXH3_128  # integrity only: no one else can write the file

    def __init__(self, weights_dir: Path) -> None:
        self.weights_dir = weights_dir
        self._swept = False  # leftovers are removed at the first push (rank 0 only pushes)
        self.spool = Spool(weights_dir)

    def _sweep(self) -> None:
        self.weights_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for old in [*self.weights_dir.glob(self.PATTERN), *self.weights_dir.glob(self.PATTERN + ".tmp")]:
            old.unlink(missing_ok=True)
        self._swept = True

    def path(self, version: int) -> Path:
        return self.weights_dir / f"v{version:09d}.shm.safetensors"

    def prepare(self, params: Weights, version: int, probe: Sequence[Sequence[int]]) -> list[WeightUpdateMessage]:
        if not self._swept:
            self._sweep()
        if isinstance(params, MappedWeights):  # the gather wrote and hashed it already: the version's name only
            _check_algorithm(params, self.checksum_algorithm)
            params.link(self.path(version))
            return [WeightUpdateMessage(manifest=params.manifest(version, probe, self.path(version)))]
        return [
            WeightUpdateMessage(
                manifest=write_mapped(params, version, probe, self.path(version), self.checksum_algorithm)
            )
        ]

    def spool_path(self) -> Path:
        return self.spool.path()

    def deliver(self, params: Weights, messages: Sequence[WeightUpdateMessage], n: int) -> Delivery:
        return PointToPoint(messages)

    def after_success(self, version: int) -> None:
        for old in self.weights_dir.glob(self.PATTERN):
            if old.name <= self.path(version).name:  # zero-padded versions: names sort like versions
                old.unlink(missing_ok=True)


class CollectiveTransport:
    """The manifest (checksum over the snapshot, as every transport's) on each replica's call, with its join of the
    update's group; the tensors by broadcast from this process (relayrl.common.collective_weights)."""

    checksum_algorithm = CHECKSUM_ALGORITHM_SHA256  # the bytes may cross a network

    def __init__(self, host: CollectiveHost, device: torch.device, weights_dir: Path | None = None) -> None:
        self.host, self.device = host, device
        self.spool = Spool(weights_dir) if weights_dir is not None else None

    def prepare(self, params: Weights, version: int, probe: Sequence[Sequence[int]]) -> list[WeightUpdateMessage]:
        if isinstance(params, MappedWeights):
            _check_algorithm(params, self.checksum_algorithm)
            return [WeightUpdateMessage(manifest=params.manifest(version, probe))]
        return [WeightUpdateMessage(manifest=manifest(params, version, probe))]

    def spool_path(self) -> Path:
        if self.spool is None:
            raise RuntimeError("a sharded publication needs a weights directory to spool into")
        return self.spool.path()

    def deliver(self, params: Weights, messages: Sequence[WeightUpdateMessage], n: int) -> Delivery:
        return Broadcast(self.host.session(n, self.device), params, messages[-1])

    def after_success(self, version: int) -> None:
        pass  # nothing stays behind


class Broadcast:
    """One collective push: replica ``i`` is rank ``i + 1``; :meth:`run` gathers the members and broadcasts."""

    def __init__(self, session: CollectiveSession, params: Weights, message: WeightUpdateMessage) -> None:
        self.session, self.message = session, message
        self.tensors = params.tensors() if isinstance(params, MappedWeights) else params
        self.layout = layout_digest((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in self.tensors.items())

    def messages(self, i: int) -> Sequence[WeightUpdateMessage]:
        m = WeightUpdateMessage()
        m.CopyFrom(self.message)
        m.manifest.collective.CopyFrom(self.session.join(i + 1, self.layout))
        return [m]

    def run(self, failed: Callable[[int], bool]) -> int:
        self.session.gather_members(lambda rank: failed(rank - 1), laggard_grace_s)
        return self.session.broadcast(self.tensors)


def _check_algorithm(params: MappedWeights, algorithm: int) -> None:
    """A gathered file is sent with the checksum it was written with: it must be the transport's own."""
    if params.algorithm != algorithm:
        raise ValueError(
            f"{params.path} was hashed with checksum algorithm {params.algorithm}; this transport sends {algorithm}"
        )


TRANSPORTS: dict[WeightTransport, Callable[[TransportSettings], Transport]] = {
    WeightTransport.GRPC_STREAM: lambda s: GrpcStreamTransport(s.chunk_bytes, s.weights_dir),
    WeightTransport.SHARED_PATH: lambda s: SharedPathTransport(s.weights_dir),
    WeightTransport.SHARED_MEMORY: lambda s: SharedMemoryTransport(s.weights_dir),
    WeightTransport.COLLECTIVE: lambda s: CollectiveTransport(_host(s), s.device or torch.device("cpu"), s.weights_dir),
}


def _host(settings: TransportSettings) -> CollectiveHost:
    if settings.collective is None:
        raise ValueError("the collective transport needs its store's address (trainer.publication.collective_address)")
    return settings.collective


def collective_host(pc: PublicationConfig, needed: bool = False) -> CollectiveHost | None:
    """The collective transport's store, as trainer.publication sets it, when the publication's transport is
    collective or some replica's is (``needed``); else None."""
    if pc.transport is not WeightTransport.COLLECTIVE and not needed:
        return None
    host, _, port = pc.collective_address.rpartition(":")
    return CollectiveHost(host, int(port), pc.collective_backend.value, pc.collective_timeout_s)


def resolve_transport(kind: WeightTransport) -> WeightTransport:
    """``auto`` left unresolved (a service started on its own, which cannot know that inference shares its
    filesystem) is ``grpc_stream``; ``relayrl run`` resolves it to ``shared_memory`` before it starts the services
    (relayrl.launcher). Any other choice stands."""
    return WeightTransport.GRPC_STREAM if kind is WeightTransport.AUTO else kind


def make_transport(
    kind: WeightTransport,
    chunk_bytes: int,
    weights_dir: Path,
    collective: CollectiveHost | None = None,
    device: torch.device | None = None,
) -> Transport:
    return TRANSPORTS[resolve_transport(kind)](TransportSettings(chunk_bytes, weights_dir, collective, device))
