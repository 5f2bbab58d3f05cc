"""Prompt datasets: JSONL rows with `prompt` (text) or `messages` (a conversation in the OpenAI chat format, rendered
by inference with the model's chat template), `answer`, optional `id` and metadata, and a resumable cursor."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.config.typed import ConfigError


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


def _messages(value: object, where: str, field_name: str) -> tuple[tuple[str, str], ...]:
    if not (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"] and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        raise ConfigError(
            field_name,
            where,
            "`messages` must be a non-empty list of objects with a string `role` and a string `content`",
        )
    return tuple((m["role"], m["content"]) for m in value)


def _row(obj: object, where: str, lineno: int, field_name: str) -> Prompt:
    if not isinstance(obj, dict):
        raise ConfigError(field_name, where, "each row must be a JSON object")
    if ("prompt" in obj) == ("messages" in obj):
        raise ConfigError(field_name, where, "each row needs exactly one of a non-empty string `prompt` or `messages`")
    if "answer" not in obj:
        raise ConfigError(field_name, where, "each row needs an `answer`")
    meta = {k: v for k, v in obj.items() if k not in ("prompt", "messages", "answer", "id")}
    if "messages" in obj:
        messages = _messages(obj["messages"], where, field_name)
        last_user = next((c for r, c in reversed(messages) if r == "user"), messages[-1][1])
        return Prompt(str(obj.get("id", lineno)), last_user, str(obj["answer"]), meta, messages)
    if not isinstance(obj["prompt"], str) or not obj["prompt"]:
        raise ConfigError(field_name, where, "each row needs a non-empty string `prompt`")
    return Prompt(str(obj.get("id", lineno)), obj["prompt"], str(obj["answer"]), meta)


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
            rows.append(_row(obj, f"{path}:{lineno}", lineno, field_name))
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
