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
    """Endless iteration over a dataset, epoch by epoch, optionally shuffled with a seeded order."""

    def __init__(self, rows: list[Prompt], shuffle: bool, seed: int, epoch: int = 0, index: int = 0) -> None:
        self.rows = rows
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = epoch
        self.index = index
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next(self) -> Prompt:
        if self.index >= len(self._order):
            self.epoch += 1
            self.index = 0
            self._order = self._make_order()
        row = self.rows[self._order[self.index]]
        self.index += 1
        return row
