"""Prompt datasets: JSONL rows with `prompt`, `answer`, optional `id` and metadata, and a resumable cursor."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.common.config import ConfigError


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    prompt: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


def load_jsonl(path: Path, field_name: str = "rollout.dataset") -> list[Prompt]:
    if not path.is_file():
        raise ConfigError(field_name, str(path), "dataset file does not exist")
    rows: list[Prompt] = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(field_name, f"{path}:{lineno}", f"line is not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                raise ConfigError(field_name, f"{path}:{lineno}", "each row needs a non-empty string `prompt`")
            if "answer" not in obj:
                raise ConfigError(field_name, f"{path}:{lineno}", "each row needs an `answer`")
            meta = {k: v for k, v in obj.items() if k not in ("prompt", "answer", "id")}
            rows.append(Prompt(str(obj.get("id", lineno)), obj["prompt"], str(obj["answer"]), meta))
    if not rows:
        raise ConfigError(field_name, str(path), "dataset has no rows")
    return rows


class PromptCursor:
    """The dataset in epoch-by-epoch order (optionally shuffled with a seeded order per epoch), addressed by
    a global sequence number: seq -> (epoch, index) -> row. Deterministic, so a restart can regenerate any
    seq."""

    def __init__(self, rows: list[Prompt], shuffle: bool, seed: int) -> None:
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
