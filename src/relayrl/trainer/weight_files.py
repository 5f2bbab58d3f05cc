"""Weight files written in one pass: the file transports' safetensors files and the spool of a sharded publication.

:class:`StreamedWriter` takes the tensors one at a time, in name order, and writes each into the file and into the
checksum of relayrl.common.weights (the one inference recomputes: SHA-256, or the algorithm the writer is given, which
the manifest then names) as it arrives, so the caller may drop it at once: the writer holds nothing but the header.
The header (names, dtypes, shapes, offsets) is known beforehand from the specs, so the file is written front to back.
:func:`write_mapped` (the shared-memory transport's file, XXH3-128) is the same writer fed from a whole snapshot at
once: the bytes of tensors that share a storage (a packed snapshot) are cut from one view of it
(relayrl.common.tensor_views) and written with a few gathered writes.

:class:`MappedWeights` is a finished file kept open: its manifest fields, its tensors as views of a private memory
map (no copy in the process's own memory: the pages are the file's, in the page cache), hard links under other
names (a transport's versioned file), and its UpdateWeights chunks read from the file one at a time
(:class:`FileUpdateMessages`). The file stays readable by whoever holds the object after :meth:`MappedWeights.release`
removed its name.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import torch

from relayrl.common.pb.inference_pb2 import (
    CHECKSUM_ALGORITHM_SHA256,
    CHECKSUM_ALGORITHM_XXH3_128,
    TensorChunk,
    TokenIds,
    WeightManifest,
    WeightUpdateMessage,
)
from relayrl.common.tensor_views import byte_views, tensor_bytes
from relayrl.common.weights import (
    SAFETENSORS_DTYPES,
    TensorSpec,
    dtype_name,
    hash_header,
    hasher,
    tensor_views,
)


class StreamedWriter:
    """A safetensors file (created 0600 under a ``.tmp`` name, never through a symlink, no fsync) written one
    tensor at a time in name order, hashed in the same pass by ``algorithm`` (a manifest's checksum_algorithm);
    :meth:`finish` renames it into place."""

    def __init__(self, path: Path, specs: Mapping[str, TensorSpec], algorithm: int = CHECKSUM_ALGORITHM_SHA256) -> None:
        self.path = path
        self.algorithm = algorithm
        self.specs = dict(specs)
        self.names = sorted(specs)
        header: dict[str, Any] = {}
        offset = 0
        for name in self.names:
            spec = specs[name]
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        self.total_bytes = offset
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # data starts 8-byte aligned
        self.data_start = 8 + len(head)
        self._hash = hasher(algorithm)
        self._next = 0
        self._tmp = path.with_name(path.name + ".tmp")
        self._tmp.unlink(missing_ok=True)
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            write_all(self._fd, [struct.pack("<Q", len(head)) + head])
        except BaseException:
            self.abort()
            raise

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write and hash the next tensor (names in sorted order, each as its spec says); the caller may drop it."""
        self._check(self._next, name, tensor)
        self._put([(name, tensor_bytes(tensor))])

    def add_all(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write and hash every remaining tensor at once (a whole snapshot): bytes cut per storage, not per tensor,
        and a few gathered writes rather than one system call per tensor."""
        names = self.names[self._next :]
        if len(tensors) != len(names):
            raise ValueError(f"{len(tensors)} tensors given, {len(names)} remain to be written")
        for i, name in enumerate(names, self._next):
            self._check(i, name, tensors[name])
        views = byte_views({name: tensors[name] for name in names})
        self._put([(name, views[name]) for name in names])

    def _check(self, index: int, name: str, tensor: torch.Tensor) -> None:
        """``tensor`` may be written as the ``index``-th tensor of the file."""
        if index >= len(self.names) or name != self.names[index]:
            expected = self.names[index] if index < len(self.names) else "nothing"
            raise ValueError(f"tensor {name!r} out of order: {expected!r} comes next")
        spec = self.specs[name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"{name}: {dtype_name(tensor.dtype)}{list(tensor.shape)} != {dtype_name(spec.dtype)}{list(spec.shape)}"
            )

    def _put(self, views: Sequence[tuple[str, memoryview]]) -> None:
        """Hash and write ``views`` (the next tensors' names and bytes, in order, already checked)."""
        if self._fd is None:
            raise ValueError(f"{self.path}: the writer was finished or aborted")
        for name, data in views:
            spec = self.specs[name]
            hash_header(self._hash, name, dtype_name(spec.dtype), spec.shape)
            self._hash.update(data)
        write_all(self._fd, [data for _, data in views])
        self._next += len(views)

    def finish(self) -> MappedWeights:
        """Every tensor written: the file under its name, kept open."""
        if self._next != len(self.names):
            self.abort()
            raise ValueError(
                f"{len(self.names) - self._next} tensors were never written, e.g. {self.names[self._next]}"
            )
        self._close()
        os.replace(self._tmp, self.path)
        return MappedWeights(
            self.path, self.specs, self.data_start, self.total_bytes, self._hash.hexdigest(), self.algorithm
        )

    def abort(self) -> None:
        self._close()
        self._tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def write_all(fd: int, buffers: Sequence[bytes | memoryview], batch: int = 512) -> None:
    """Write ``buffers`` in order with os.writev (``batch`` at a time, under the system's IOV_MAX), finishing a
    short write with plain writes."""
    for i in range(0, len(buffers), batch):
        part = buffers[i : i + batch]
        skip = os.writev(fd, part)
        for buf in part:
            if skip >= len(buf):
                skip -= len(buf)
                continue
            rest, skip = memoryview(buf)[skip:], 0
            while rest:
                rest = rest[os.write(fd, rest) :]


def write_mapped(
    tensors: Mapping[str, torch.Tensor],
    version: int,
    probe: Sequence[Sequence[int]],
    path: Path,
    algorithm: int = CHECKSUM_ALGORITHM_XXH3_128,
) -> WeightManifest:
    """Shared-memory transport, sender side: one pass over the tensors writes them into a safetensors file
    (created 0600, never followed through a symlink, no fsync: it lives in the page cache or a tmpfs for the
    seconds until inference has copied it) and hashes the same bytes (XXH3-128 by default: see
    relayrl.common.weights); returns the manifest naming the file and the algorithm."""
    writer = StreamedWriter(path, {name: TensorSpec(t.dtype, tuple(t.shape)) for name, t in tensors.items()}, algorithm)
    try:
        writer.add_all(tensors)
    except BaseException:
        writer.abort()
        raise
    return writer.finish().manifest(version, probe, path)


class MappedWeights:
    """A finished weight file, held open (the descriptor lives as long as this object)."""

    def __init__(
        self,
        path: Path,
        specs: Mapping[str, TensorSpec],
        data_start: int,
        total_bytes: int,
        sha256: str,
        algorithm: int = CHECKSUM_ALGORITHM_SHA256,
    ) -> None:
        self.path = path
        self.specs = dict(specs)
        self.data_start = data_start
        self.total_bytes = total_bytes
        self.sha256 = sha256  # the hex digest by ``algorithm`` (the manifest field keeps its historical name)
        self.algorithm = algorithm
        self.fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        self._closer = weakref.finalize(self, os.close, self.fd)

    @property
    def num_tensors(self) -> int:
        return len(self.specs)

    def manifest(self, version: int, probe: Sequence[Sequence[int]], path: Path | None = None) -> WeightManifest:
        """The manifest of this file as ``version``; ``path``: the name inference reads (file transports)."""
        return WeightManifest(
            version=version,
            num_tensors=self.num_tensors,
            total_bytes=self.total_bytes,
            sha256=self.sha256,
            path=str(path.resolve()) if path is not None else "",
            probe=[TokenIds(ids=list(seq)) for seq in probe],
            checksum_algorithm=self.algorithm,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as views of a private, copy-on-write map of the file (never written: the pages stay the
        page cache's); the map closes when the last view goes."""
        if self.total_bytes == 0:
            return {name: torch.empty(spec.shape, dtype=spec.dtype) for name, spec in self.specs.items()}
        size = os.fstat(self.fd).st_size
        return tensor_views(mmap.mmap(self.fd, size, access=mmap.ACCESS_COPY))

    def link(self, dest: Path) -> None:
        """``dest`` names this file: a hard link, or a copy made through the open descriptor (a filesystem
        without hard links, or a name already released)."""
        dest.unlink(missing_ok=True)
        try:
            os.link(self.path, dest)
            return
        except OSError:
            pass
        tmp = dest.with_name(dest.name + ".tmp")
        tmp.unlink(missing_ok=True)
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(os.dup(self.fd), "rb") as src, os.fdopen(out, "wb") as dst:
            src.seek(0)
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, dest)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def release(self) -> None:
        """Remove this file's own name (readers holding the object keep reading it; links stay)."""
        self.path.unlink(missing_ok=True)


class FileUpdateMessages(Sequence[WeightUpdateMessage]):
    """The UpdateWeights stream of a :class:`MappedWeights` (the chunks of iter_update_messages, then the
    manifest), each chunk read from the file when it is asked for: one chunk's bytes at a time, and the whole
    stream can be sent again (a retried push). ``reads_file`` tells the client to ask from a worker thread."""

    reads_file = True

    def __init__(self, weights: MappedWeights, version: int, chunk_bytes: int, probe: Sequence[Sequence[int]]) -> None:
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        self.weights = weights
        self.chunk_bytes = chunk_bytes
        self._manifest = WeightUpdateMessage(manifest=weights.manifest(version, probe))
        self._chunks: list[tuple[str, int, int]] = []  # (name, the tensor's offset in the file, offset in it)
        offset = weights.data_start
        for name in sorted(weights.specs):
            nbytes = weights.specs[name].nbytes
            self._chunks += [(name, offset, start) for start in range(0, max(nbytes, 1), chunk_bytes)]
            offset += nbytes

    def __len__(self) -> int:
        return len(self._chunks) + 1

    @overload
    def __getitem__(self, index: int) -> WeightUpdateMessage: ...

    @overload
    def __getitem__(self, index: slice) -> list[WeightUpdateMessage]: ...

    def __getitem__(self, index: int | slice) -> WeightUpdateMessage | list[WeightUpdateMessage]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index == len(self._chunks):
            return self._manifest
        name, base, start = self._chunks[index]
        spec = self.weights.specs[name]
        size = min(self.chunk_bytes, spec.nbytes - start)
        data = os.pread(self.weights.fd, size, base + start) if size else b""
        if len(data) != size:
            raise OSError(f"weight file {self.weights.path} is shorter than its header says")
        return WeightUpdateMessage(
            chunk=TensorChunk(
                name=name,
                dtype=dtype_name(spec.dtype),
                shape=list(spec.shape),
                offset=start,
                total_bytes=spec.nbytes,
                data=data,
            )
        )

    def __iter__(self) -> Iterator[WeightUpdateMessage]:
        for i in range(len(self)):
            yield self[i]
