"""Dataset files read row by row: JSONL (an index of line offsets, one line read per row), Parquet (one row group
read per row, a few kept), Arrow IPC files and the folders `datasets`' ``save_to_disk`` writes (memory-mapped), and a
folder of shards of one format. Nothing reads a whole file into memory; pyarrow is imported only for the columnar
formats.

A :class:`RowSource` numbers its rows 0..n-1 across its files and gives each raw row (a ``dict`` for a JSON object
or an Arrow record), where it lies (``file:line`` or ``file row N``) and its default id.
"""

from __future__ import annotations

import json
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from relayrl.config.dataset import DatasetFormat
from relayrl.config.typed import ConfigError

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
SUFFIXES = {
    DatasetFormat.JSONL: JSON_SUFFIXES,
    DatasetFormat.PARQUET: (".parquet",),
    DatasetFormat.ARROW: (".arrow", ".feather", ".ipc"),
}
SCAN_BATCH = 1024  # rows decoded at once while the dataset is checked
ROW_GROUPS_KEPT = 4  # Parquet row groups kept decoded (a shuffled order reads one per row otherwise)


class NotJson:
    """A JSONL line that does not parse (kept as a row, so that the check reports it with its place)."""

    def __init__(self, message: str) -> None:
        self.message = message


class RowSource(Protocol):
    path: Path

    def __len__(self) -> int: ...

    def row(self, i: int) -> Any: ...

    def where(self, i: int) -> str: ...

    def default_id(self, i: int) -> str: ...

    def scan(self) -> Iterator[Any]: ...


def _parse_line(line: bytes) -> Any:
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return NotJson(f"line is not valid JSON ({getattr(exc, 'msg', exc)})")


class JsonlFile:
    """One JSONL file: the byte offset and line number of every non-blank line, found in one streamed pass."""

    def __init__(self, path: Path, field_name: str) -> None:
        self.path = path
        self.offsets, self.lines = array("q"), array("q")
        with path.open("rb") as f:
            offset = 0
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    if not self.offsets and line.lstrip().startswith(b"[") and path.suffix == ".json":
                        raise ConfigError(field_name, str(path), "a JSON array: write one object per line (JSONL)")
                    self.offsets.append(offset)
                    self.lines.append(lineno)
                offset += len(line)
        self._file = path.open("rb")
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.offsets)

    def row(self, i: int) -> Any:
        with self._lock:
            self._file.seek(self.offsets[i])
            line = self._file.readline()
        return _parse_line(line)

    def where(self, i: int) -> str:
        return f"{self.path}:{self.lines[i]}"

    def default_id(self, i: int) -> str:
        return str(self.lines[i])

    def scan(self) -> Iterator[Any]:
        with self.path.open("rb") as f:
            for line in f:
                if line.strip():
                    yield _parse_line(line)


class ArrowFile:
    """An Arrow IPC file (file or stream format), memory-mapped: pages are read as rows are."""

    def __init__(self, path: Path) -> None:
        import pyarrow as pa

        self.path = path
        source = pa.memory_map(str(path))
        try:
            self.table = pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            self.table = pa.ipc.open_stream(source).read_all()

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def row(self, i: int) -> Any:
        return self.table.slice(i, 1).to_pylist()[0]

    def where(self, i: int) -> str:
        return f"{self.path} row {i + 1}"

    def default_id(self, i: int) -> str:
        return str(i + 1)

    def scan(self) -> Iterator[Any]:
        for batch in self.table.to_batches(max_chunksize=SCAN_BATCH):
            yield from batch.to_pylist()


class ParquetFile:
    """A Parquet file read one row group at a time (the last few kept decoded)."""

    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq

        self.path = path
        self.file = pq.ParquetFile(str(path))
        meta = self.file.metadata
        self.starts = [0]
        for g in range(meta.num_row_groups):
            self.starts.append(self.starts[-1] + meta.row_group(g).num_rows)
        self._groups: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.starts[-1]

    def row(self, i: int) -> Any:
        g = bisect_right(self.starts, i) - 1
        with self._lock:
            table = self._groups.pop(g, None)
            if table is None:
                table = self.file.read_row_group(g)
            self._groups[g] = table
            while len(self._groups) > ROW_GROUPS_KEPT:
                self._groups.popitem(last=False)
        return table.slice(i - self.starts[g], 1).to_pylist()[0]

    def where(self, i: int) -> str:
        return f"{self.path} row {i + 1}"

    def default_id(self, i: int) -> str:
        return str(i + 1)

    def scan(self) -> Iterator[Any]:
        for batch in self.file.iter_batches(batch_size=SCAN_BATCH):
            yield from batch.to_pylist()


class Shards:
    """Several sources as one, in order; a row's default id carries its file's name."""

    def __init__(self, folder: Path, sources: list[RowSource]) -> None:
        self.path, self.sources = folder, sources
        self.starts = [0]
        for s in sources:
            self.starts.append(self.starts[-1] + len(s))

    def _locate(self, i: int) -> tuple[RowSource, int]:
        k = bisect_right(self.starts, i) - 1
        return self.sources[k], i - self.starts[k]

    def __len__(self) -> int:
        return self.starts[-1]

    def row(self, i: int) -> Any:
        source, j = self._locate(i)
        return source.row(j)

    def where(self, i: int) -> str:
        source, j = self._locate(i)
        return source.where(j)

    def default_id(self, i: int) -> str:
        source, j = self._locate(i)
        return f"{source.path.name}:{source.default_id(j)}"

    def scan(self) -> Iterator[Any]:
        for s in self.sources:
            yield from s.scan()


def _read(fmt: DatasetFormat, path: Path, field_name: str) -> RowSource:
    if fmt is DatasetFormat.JSONL:
        return JsonlFile(path, field_name)
    return ParquetFile(path) if fmt is DatasetFormat.PARQUET else ArrowFile(path)


def _format_of(path: Path, field_name: str) -> DatasetFormat:
    for fmt, suffixes in SUFFIXES.items():
        if path.suffix.lower() in suffixes:
            return fmt
    known = ", ".join(s for suffixes in SUFFIXES.values() for s in suffixes)
    raise ConfigError(field_name, str(path), f"unknown dataset file type: name it {known}, or set the format")


def _folder_files(path: Path, fmt: DatasetFormat, field_name: str) -> tuple[DatasetFormat, list[Path]]:
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    if fmt is DatasetFormat.AUTO:
        formats = {f: _format_of(f, field_name) for f in files if any(f.suffix.lower() in s for s in SUFFIXES.values())}
        if len(set(formats.values())) > 1:
            raise ConfigError(field_name, str(path), "a folder of shards must hold files of one format")
        fmt = next(iter(formats.values()), DatasetFormat.JSONL)
    shards = [f for f in files if f.suffix.lower() in SUFFIXES[fmt]]
    if not shards:
        raise ConfigError(field_name, str(path), f"the folder holds no {fmt.value} files")
    return fmt, shards


def _hf_disk_files(path: Path, field_name: str) -> list[Path]:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise ConfigError(field_name, str(path), f"a DatasetDict: name one split's folder ({', '.join(splits)})")
    state = json.loads((path / "state.json").read_text())
    return [path / f["filename"] for f in state.get("_data_files", [])]


def open_source(path: Path, fmt: DatasetFormat, field_name: str) -> RowSource:
    """The rows of ``path`` in ``fmt`` (auto: by the suffix, or by the folder's contents)."""
    if not path.exists():
        raise ConfigError(field_name, str(path), "dataset file does not exist")
    if path.is_dir():
        is_hf = (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
        if fmt is DatasetFormat.HF_DISK or (fmt is DatasetFormat.AUTO and is_hf):
            files, fmt = _hf_disk_files(path, field_name), DatasetFormat.ARROW
        else:
            fmt, files = _folder_files(path, fmt, field_name)
        sources = [_read(fmt, f, field_name) for f in files]
        if not sources:
            raise ConfigError(field_name, str(path), "the folder holds no data files")
        return sources[0] if len(sources) == 1 else Shards(path, sources)
    if fmt is DatasetFormat.HF_DISK:
        raise ConfigError(field_name, str(path), "format hf_disk needs the folder save_to_disk wrote")
    return _read(_format_of(path, field_name) if fmt is DatasetFormat.AUTO else fmt, path, field_name)
