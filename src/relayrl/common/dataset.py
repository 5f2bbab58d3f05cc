"""Prompt datasets: rows with a prompt (text) or a conversation (OpenAI chat format, rendered by inference with the
model's chat template), an answer, an optional id and metadata, under the field names the config gives
(relayrl.config.dataset); the files are read row by row (relayrl.common.dataset_files). :func:`open_prompts` checks
every row once, streamed, and splits off the held-out rows; :class:`PromptCursor` orders the training rows."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

from relayrl.common.dataset_files import NotJson, RowSource, open_source
from relayrl.config.dataset import BadRows, DatasetFields, DatasetSpec
from relayrl.config.rollout import RolloutConfig
from relayrl.config.typed import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    prompt: str  # the text prompt; for a `messages` row, the content of its last user message (for verifiers)
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) of a `messages` row; empty for a text prompt

    def chat(self) -> list[dict[str, str]]:
        """The conversation in the OpenAI chat format (empty for a text prompt)."""
        return [{"role": role, "content": content} for role, content in self.messages]


class RowError(Exception):
    """A row relayrl cannot read: the field and the rule it breaks."""

    def __init__(self, field_name: str, rule: str) -> None:
        super().__init__(f"field `{field_name}`: {rule}" if field_name else rule)


_MISSING = object()


def _get(obj: dict[str, Any], dotted: str) -> Any:
    value: Any = obj
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _messages(value: object, name: str) -> tuple[tuple[str, str], ...]:
    if not (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"] and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        raise RowError(name, "must be a non-empty list of objects with a string `role` and a string `content`")
    return tuple((m["role"], m["content"]) for m in value)


def parse_row(obj: object, fields: DatasetFields, default_id: str) -> Prompt:
    """The prompt of one raw row, or :class:`RowError`."""
    if isinstance(obj, NotJson):
        raise RowError("", obj.message)
    if not isinstance(obj, dict):
        raise RowError("", "each row must be an object")
    prompt, messages = _get(obj, fields.prompt), _get(obj, fields.messages)
    if (prompt is _MISSING or prompt is None) == (messages is _MISSING or messages is None):
        raise RowError(f"{fields.prompt}/{fields.messages}", "each row needs exactly one of a prompt or messages")
    answer, row_id = _get(obj, fields.answer), _get(obj, fields.id)
    if answer is _MISSING or answer is None:
        raise RowError(fields.answer, "each row needs an answer")
    top = {f.partition(".")[0] for f in (fields.prompt, fields.messages, fields.answer, fields.id)}
    meta = {k: v for k, v in obj.items() if k not in top}
    row_id = default_id if row_id is _MISSING or row_id is None else str(row_id)
    if prompt is _MISSING or prompt is None:
        turns = _messages(messages, fields.messages)
        last_user = next((c for r, c in reversed(turns) if r == "user"), turns[-1][1])
        return Prompt(row_id, last_user, str(answer), meta, turns)
    if not isinstance(prompt, str) or not prompt:
        raise RowError(fields.prompt, "must be a non-empty string")
    return Prompt(row_id, prompt, str(answer), meta)


class Prompts(Sequence[Prompt]):
    """Some rows of a dataset (a split), read when asked for."""

    def __init__(self, source: RowSource, fields: DatasetFields, rows: np.ndarray) -> None:
        self.source, self.fields, self.rows = source, fields, rows  # the source's row numbers (8 bytes a row)

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Prompt: ...

    @overload
    def __getitem__(self, i: slice) -> list[Prompt]: ...

    def __getitem__(self, i: int | slice) -> Prompt | list[Prompt]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        n = int(self.rows[i])
        try:
            return parse_row(self.source.row(n), self.fields, self.source.default_id(n))
        except RowError as exc:  # checked at the start: the file changed since
            raise ConfigError("dataset", self.source.where(n), str(exc)) from None

    def __iter__(self) -> Iterator[Prompt]:
        return (self[j] for j in range(len(self)))


@dataclass
class PromptSet:
    """A dataset checked row by row: the training rows, the held-out rows and how many bad rows were skipped."""

    train: Prompts
    held_out: Prompts
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)  # the first few skipped rows: where and why


def _check_rows(source: RowSource, spec: DatasetSpec) -> tuple[np.ndarray, int, list[str]]:
    """Every row parsed once, streamed; the numbers of the good rows."""
    bad: list[int] = []
    reasons: list[str] = []
    for n, obj in enumerate(source.scan()):
        try:
            parse_row(obj, spec.fields, "")
        except RowError as exc:
            if spec.bad_rows is BadRows.ERROR:
                raise ConfigError(
                    spec.field_name, source.where(n), f"{exc} (rollout.bad_rows: skip leaves such rows out)"
                ) from None
            bad.append(n)
            if len(reasons) < 5:
                reasons.append(f"{source.where(n)}: {exc}")
    good = np.setdiff1d(np.arange(len(source), dtype=np.int64), np.asarray(bad, dtype=np.int64))
    return good, len(bad), reasons


def open_prompts(spec: DatasetSpec) -> PromptSet:
    """The dataset of ``spec``, checked, with ``spec.held_out_rows`` rows (a seeded choice) held out."""
    source = open_source(spec.path, spec.format, spec.field_name)
    good, skipped, reasons = _check_rows(source, spec)
    n = len(good)
    if n == 0:
        raise ConfigError(spec.field_name, str(spec.path), "dataset has no rows" + (" it can read" if skipped else ""))
    if skipped:
        log.warning("%s: %d bad rows skipped (rollout.bad_rows: skip), first: %s", spec.path, skipped, reasons)
    if spec.held_out_rows >= n:
        raise ConfigError("rollout.held_out_rows", spec.held_out_rows, f"must be less than the dataset's {n} rows")
    picked = np.sort(np.asarray(random.Random(spec.seed).sample(range(n), spec.held_out_rows), dtype=np.int64))
    train, held_out = np.delete(good, picked), good[picked]
    return PromptSet(Prompts(source, spec.fields, train), Prompts(source, spec.fields, held_out), skipped, reasons)


def eval_prompts(rc: RolloutConfig, dataset: Path | None, field_name: str) -> Prompts:
    """The rows an evaluation scores: every row of ``dataset``, read like the rollout's dataset (its format and
    fields), or else the rows the rollout's dataset holds out (rollout.held_out_rows)."""
    if dataset is not None:
        return open_prompts(rc.dataset_spec(dataset, field_name)).train
    if not rc.held_out_rows:
        raise ConfigError(
            field_name, None, "name a dataset, or hold rows out of the training one (rollout.held_out_rows)"
        )
    return open_prompts(rc.dataset_spec()).held_out


class PromptCursor:
    """The dataset in epoch-by-epoch order (optionally shuffled with a seeded order per epoch), addressed by
    a global sequence number: seq -> (epoch, index) -> row. Deterministic, so a restart can regenerate any
    seq."""

    def __init__(self, rows: Sequence[Prompt], shuffle: bool, seed: int) -> None:
        self.rows = rows
        self.shuffle = shuffle
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # keep one epoch's order cached
        return order

    def position(self, seq: int) -> tuple[int, int]:
        return divmod(seq, len(self.rows))

    def at(self, seq: int) -> Prompt:
        epoch, index = self.position(seq)
        return self.rows[self._order(epoch)[index]]
