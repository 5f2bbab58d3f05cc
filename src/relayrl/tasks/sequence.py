"""The benchmark task with longer answers: continue an arithmetic sequence modulo 10 for ``length`` digits.

Prompt ``"3+2="``, answer ``"35791357"``: the first digit is the start, each next one the previous plus the step,
modulo 10. Scored like the quickstart (:func:`relayrl.tasks.arithmetic.reward`): the fraction of positions whose
character matches, over the longer of answer and completion, so partial credit grows digit by digit and extra
characters cost credit. The maximum is 1.0.

``bench/vs_trl.py --task sequence`` uses step 0 (``"3+0="`` -> ``"33333333"``, the committed
examples/data/sequence.jsonl) with ``max_new_tokens: 8``: every sample generates eight tokens (generation is about
44 % of TRL's step, training the rest), and a random-init 4.7 M-parameter model learns it by RL alone within tens
of steps. ``--task sequence32`` asks for thirty-two digits (:func:`make_long_dataset`, examples/data/sequence32.jsonl)
from 4 prompts x 8 samples per step: small decode batches over many tokens, where generation dominates a
synchronous loop's step. Steps 1-3 (count up, or by two or three) are far harder from random init: measured with
TRL's GRPOTrainer on the same model, the reward rose only from 0.08 to 0.14 in 300 steps (steps 1-3) and from 0.10
to 0.17 in 200 steps (step 1), too slowly for a benchmark of time to threshold.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from relayrl.tasks.arithmetic import reward

__all__ = ["LONG_LENGTH", "MAX_REWARD", "make_dataset", "make_long_dataset", "reward", "sequence"]

LONG_LENGTH = 32  # digits of the long variant's answers (bench/vs_trl.py --task sequence32)

MAX_REWARD = 1.0


def sequence(start: int, step: int, length: int) -> str:
    """The answer: ``length`` digits from ``start``, each the previous plus ``step`` modulo 10."""
    return "".join(str((start + k * step) % 10) for k in range(length))


def make_dataset(path: Path, length: int = 8, steps: tuple[int, ...] = (0,), seed: int = 0) -> int:
    """Write every ``start+step=`` (start 0-9, each step in ``steps``) with its ``length``-digit answer to ``path``
    (JSONL), shuffled; returns the count."""
    if length < 1 or not steps:
        raise ValueError("length must be >= 1 and steps not empty")
    rows = [
        {"id": f"{start}+{step}", "prompt": f"{start}+{step}=", "answer": sequence(start, step, length)}
        for step in steps
        for start in range(10)
    ]
    random.Random(seed).shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows)


def make_long_dataset(path: Path) -> int:
    """The long variant (``"3+0="`` -> thirty-two ``3``): :func:`make_dataset` with ``LONG_LENGTH`` digits, step 0."""
    return make_dataset(path, length=LONG_LENGTH)
