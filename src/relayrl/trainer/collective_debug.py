"""Find the first collective where the ranks of a run diverged, from the records :class:`Collectives` writes.

With ``record_dir`` set, every rank appends one JSON line per collective to ``<record_dir>/rank<R>.jsonl``
*before* it runs the collective, so the last line of a rank is the call it was blocked in or failed at.
This module reads those files (``RUN_DIR/collectives/``, or the folder given directly) and compares the
ranks' sequences position by position. The first position where the ranks called different things (op,
name, group, world size, shapes, dtypes, reduce op or source rank), or where some rank had called nothing,
is the divergence: the place a job hangs (or times out) because the ranks no longer call the same collective.

``relayrl debug collectives RUN_DIR`` runs :func:`main`: exit 0 when all ranks agree, 1 with a report of the
first divergence, 2 when there is nothing readable to compare.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORD_SUBDIR = "collectives"
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")
# The fields compared between ranks, in the order a report lists the differing ones.
COMPARED_FIELDS = ("op", "name", "group", "world_size", "shapes", "dtypes", "reduce_op", "src")


class RecordError(ValueError):
    """A record file exists but cannot be read as a sequence of collective records."""


@dataclass(frozen=True)
class CollectiveCall:
    """One recorded collective call of one rank."""

    index: int
    op: str
    name: str
    group: str
    world_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    reduce_op: str | None
    src: int | None

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> CollectiveCall:
        """Build from one JSON record as :class:`Collectives` writes it; raises KeyError/TypeError/ValueError."""
        return cls(
            index=int(record["index"]),
            op=str(record["op"]),
            name=str(record["name"]),
            group=str(record["group"]),
            world_size=int(record["world_size"]),
            shapes=tuple(tuple(int(d) for d in shape) for shape in record["shapes"]),
            dtypes=tuple(str(d) for d in record["dtypes"]),
            reduce_op=None if record.get("reduce_op") is None else str(record["reduce_op"]),
            src=None if record.get("src") is None else int(record["src"]),
        )

    def describe(self) -> str:
        """One line: ``all_reduce(grads) reduce_op=SUM shapes=[[4, 2]] dtypes=[float32] group=default``."""
        parts = [f"{self.op}({self.name})"]
        if self.reduce_op is not None:
            parts.append(f"reduce_op={self.reduce_op}")
        if self.src is not None:
            parts.append(f"src={self.src}")
        parts.append("shapes=[" + ", ".join("[" + ", ".join(map(str, s)) + "]" for s in self.shapes) + "]")
        parts.append("dtypes=[" + ", ".join(self.dtypes) + "]")
        parts.append(f"group={self.group} world_size={self.world_size}")
        return " ".join(parts)


@dataclass(frozen=True)
class Divergence:
    """The first position where the ranks' sequences differ.

    ``calls[r]`` is what rank ``r`` called at ``index``, or None when its sequence ended before ``index``
    (it called fewer collectives). ``differing_fields`` names the compared fields whose values differ among
    the ranks that did call something there (empty when the only difference is that some ranks ended early).
    """

    index: int
    calls: dict[int, CollectiveCall | None]
    lengths: dict[int, int]
    differing_fields: tuple[str, ...]

    @property
    def ended_early(self) -> list[int]:
        return sorted(r for r, call in self.calls.items() if call is None)


def record_folder(path: Path) -> Path:
    """``RUN_DIR/collectives`` when it exists, else ``path`` itself (the records folder given directly)."""
    sub = path / RECORD_SUBDIR
    return sub if sub.is_dir() else path


def read_rank_file(path: Path) -> list[CollectiveCall]:
    """The records of one ``rank<R>.jsonl`` file, checked to be numbered 0, 1, 2, ... in order.

    An unterminated last line that is not valid JSON is dropped: the rank died while writing it.
    """
    lines = path.read_text().split("\n")  # the last item is "" when the last line is complete
    calls: list[CollectiveCall] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines):  # unterminated last line
                break
            raise RecordError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
        try:
            call = CollectiveCall.from_record(record)
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"{path}:{lineno}: not a collective record ({exc!r})") from exc
        if call.index != len(calls):
            raise RecordError(
                f"{path}:{lineno}: record index {call.index}, expected {len(calls)} "
                "(lines lost, or two runs wrote to this file)"
            )
        calls.append(call)
    return calls


def load_records(path: Path) -> dict[int, list[CollectiveCall]]:
    """All ``rank<R>.jsonl`` files of a run folder (or of the records folder itself), keyed by rank.

    Raises FileNotFoundError when the folder does not exist and RecordError when a file is malformed;
    returns an empty dict when the folder holds no rank files.
    """
    folder = record_folder(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder: {folder}")
    records: dict[int, list[CollectiveCall]] = {}
    for file in sorted(folder.iterdir()):
        match = _RANK_FILE.fullmatch(file.name)
        if match is not None and file.is_file():
            records[int(match.group(1))] = read_rank_file(file)
    return dict(sorted(records.items()))


def missing_ranks(records_by_rank: Mapping[int, Sequence[CollectiveCall]]) -> list[int]:
    """Ranks below the recorded world size that have no record file at all."""
    world_size = max((calls[0].world_size for calls in records_by_rank.values() if calls), default=0)
    return [r for r in range(world_size) if r not in records_by_rank]


def _as_call(item: CollectiveCall | Mapping[str, Any]) -> CollectiveCall:
    return item if isinstance(item, CollectiveCall) else CollectiveCall.from_record(item)


def find_divergence(
    records_by_rank: Mapping[int, Sequence[CollectiveCall | Mapping[str, Any]]],
) -> Divergence | None:
    """The first position where the ranks called different collectives (or some called none); None if all agree.

    Records may be :class:`CollectiveCall` objects or raw JSON records (dicts). Ranks are compared by
    position in their sequence; every field except ``index`` is compared.
    """
    calls_by_rank = {rank: [_as_call(c) for c in seq] for rank, seq in sorted(records_by_rank.items())}
    lengths = {rank: len(seq) for rank, seq in calls_by_rank.items()}
    for index in range(max(lengths.values(), default=0)):
        at_index: dict[int, CollectiveCall | None] = {
            rank: seq[index] if index < len(seq) else None for rank, seq in calls_by_rank.items()
        }
        present = [call for call in at_index.values() if call is not None]
        differing = tuple(name for name in COMPARED_FIELDS if len({getattr(call, name) for call in present}) > 1)
        if differing or len(present) < len(at_index):
            return Divergence(index=index, calls=at_index, lengths=lengths, differing_fields=differing)
    return None


def _rank_list(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``; a single rank -> ``"rank 3"``."""
    spans: list[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(spans)


def format_divergence(div: Divergence, previous: CollectiveCall | None = None) -> str:
    """A multi-line report of ``div``; ``previous`` is the last collective all ranks agreed on, if any."""
    reasons = []
    if div.differing_fields:
        reasons.append("differs in " + ", ".join(div.differing_fields))
    if div.ended_early:
        reasons.append(f"{_rank_list(div.ended_early)} called no collective #{div.index}")
    lines = [f"ranks diverge at collective #{div.index} ({'; '.join(reasons)}):"]
    by_description: dict[str, list[int]] = {}
    for rank, call in div.calls.items():
        key = (
            call.describe()
            if call is not None
            else f"no call: its sequence ended after {div.lengths[rank]} collectives (it returned, crashed "
            "or is stuck outside a collective)"
        )
        by_description.setdefault(key, []).append(rank)
    for description, ranks in sorted(by_description.items(), key=lambda item: item[1][0]):
        lines.append(f"  {_rank_list(ranks)}: {description}")
    if previous is not None:
        lines.append(f"last collective all ranks agree on: #{previous.index} {previous.describe()}")
    else:
        lines.append("the ranks agree on no collective before it")
    lengths: dict[int, list[int]] = {}
    for rank, n in div.lengths.items():
        lengths.setdefault(n, []).append(rank)
    lines.append(
        "collectives recorded: "
        + "; ".join(f"{_rank_list(ranks)}: {n}" for n, ranks in sorted(lengths.items(), key=lambda item: item[1][0]))
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``relayrl debug collectives RUN_DIR``: 0 when all ranks agree, 1 on a divergence, 2 on no records."""
    parser = argparse.ArgumentParser(
        prog="relayrl debug collectives",
        description="Compare the collective sequences recorded by every rank (RUN_DIR/collectives/rank<R>.jsonl) "
        "and name the first collective where they diverge.",
    )
    parser.add_argument(
        "run_dir",
        type=Path,
        metavar="RUN_DIR",
        help="the run folder (its collectives/ subfolder is read) or the records folder itself",
    )
    args = parser.parse_args(argv)

    folder = record_folder(args.run_dir)
    try:
        records: dict[int, list[CollectiveCall]] = load_records(args.run_dir)
    except FileNotFoundError:
        print(
            f"no collective records: {folder} does not exist (run the trainer with collective recording on)",
            file=sys.stderr,
        )
        return 2
    except (RecordError, OSError) as exc:
        print(f"cannot read the collective records: {exc}", file=sys.stderr)
        return 2
    if not records:
        print(f"no collective records: no rank<R>.jsonl files in {folder}", file=sys.stderr)
        return 2

    missing = missing_ranks(records)
    if missing:
        print(
            f"note: {_rank_list(missing)} left no record file (the records say world_size "
            f"{max(c[0].world_size for c in records.values() if c)}); counted as having called no collective"
        )
        records.update({rank: [] for rank in missing})
        records = dict(sorted(records.items()))

    div = find_divergence(records)
    if div is None:
        count = len(next(iter(records.values())))
        print(f"all {len(records)} ranks agree on {count} collectives ({folder})")
        return 0
    first = next(iter(records.values()))
    previous = first[div.index - 1] if div.index > 0 else None
    print(format_divergence(div, previous))
    return 1
