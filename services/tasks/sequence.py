"""The benchmark task with longer answers: continue an arithmetic sequence modulo 10 for ``length`` digits.

Prompt ``"3+2="``, answer ``"35791357"``: the first digit is the start, each next one the previous plus the step,
modulo 10 (eight digits by default, so every answer needs at least nine generated tokens with the end-of-sequence
token). Scored like the quickstart (:func:`relayrl.tasks.arithmetic.reward`): the fraction of positions whose
character matches, over the longer of answer and completion, so partial credit grows digit by digit and extra
characters cost credit. The maximum is 1.0 (the exact answer, then end of sequence).

It is made for ``bench/vs_trl.py``: a random-init model learns it by RL alone within a few hundred steps, and with
about ten generated tokens per sample generation dominates each step.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from relayrl.tasks.arithmetic import reward

__all__ = ["MAX_REWARD", "make_dataset", "reward", "sequence"]

MAX_REWARD = 1.0


def sequence(start: int, step: int, length: int) -> str:
    """The answer: ``length`` digits from ``start``, each the previous plus ``step`` modulo 10."""
    return "".join(str((start + k * step) % 10) for k in range(length))


def make_dataset(path: Path, length: int = 8, steps: tuple[int, ...] = (1, 2, 3), seed: int = 0) -> int:
    """Write every ``start+step=`` (start 0-9, each step in ``steps``) with its ``length``-digit answer to ``path``
    (JSONL), shuffled; returns the count."""
    if length < 1 or not steps:
        raise ValueError("length must be >= 1 and steps not empty")
    rows = [{"id": f"{start}+{step}", "prompt": f"{start}+{step}=", "answer": sequence(start, step, length)}
            for step in steps for start in range(10)]
    random.Random(seed).shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows)
