"""The SmolLM2 example's task: two-digit addition asked in a conversation, with a held-out split.

Rows hold ``messages`` (a system instruction and the question), rendered by the model's chat template, and the sum
as ``answer``; the example scores the last number of the completion (regex verifier). SmolLM2-135M-Instruct gets many of
these wrong in substance, not only in format (e.g. "What is 17 + 25?" -> "17 + 25 = 32").
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SYSTEM = "You are a calculator. Reply with the result only."


def rows(lo: int = 10, hi: int = 99) -> list[dict[str, object]]:
    return [
        {
            "id": f"{a}+{b}",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}],
            "answer": str(a + b),
        }
        for a in range(lo, hi + 1)
        for b in range(lo, hi + 1)
    ]


def split(heldout_rows: int = 200, seed: int = 0) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """(train, held-out): every question shuffled by ``seed``, the first ``heldout_rows`` held out."""
    everything = rows()
    random.Random(seed).shuffle(everything)
    return everything[heldout_rows:], everything[:heldout_rows]


def _write(path: Path, part: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in part))


def make_chat_dataset(train: Path, heldout: Path, heldout_rows: int = 200, seed: int = 0) -> tuple[int, int]:
    """Write a shuffled train split and a disjoint held-out split of ``heldout_rows`` questions; the counts."""
    train_rows, held_rows = split(heldout_rows, seed)
    _write(heldout, held_rows)
    _write(train, train_rows)
    return len(train_rows), len(held_rows)


def make_train_split(train: Path) -> int:
    """The train split alone, as ``relayrl make-dataset --task chat-addition`` writes it (default seed and size)."""
    train_rows, _ = split()
    _write(train, train_rows)
    return len(train_rows)
