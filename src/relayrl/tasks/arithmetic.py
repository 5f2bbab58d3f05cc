"""The quickstart task: small-integer addition, verified exactly, with partial credit per digit.

Prompt ``"3+4="``, answer ``"7"``. The completion is the generated text up to the end-of-sequence token.
Score = (number of positions where the completion's character equals the answer's) / max(len(answer),
len(completion)): 1.0 only for the exact answer, and partial credit that shrinks with extra characters.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from relayrl.reward.api import RewardInput, RewardResult


def reward(inp: RewardInput) -> RewardResult:
    answer = inp.reference.strip()
    if not answer:
        raise ValueError("the dataset row has no reference answer")
    completion = inp.completion.strip()
    matches = sum(a == b for a, b in zip(completion, answer, strict=False))
    score = matches / max(len(answer), len(completion), 1)
    exact = float(completion == answer)
    return RewardResult(score=score, components={"exact": exact, "digits": score}, details=completion[:32])


def make_dataset(path: Path, max_operand: int = 9, seed: int = 0, max_sum: int | None = None) -> int:
    """Write every ``a+b=`` with 0 <= a, b <= max_operand (and a + b <= max_sum, if given) to ``path``
    (JSONL), shuffled; returns the count."""
    rows = [
        {"id": f"{a}+{b}", "prompt": f"{a}+{b}=", "answer": str(a + b)}
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if max_sum is None or a + b <= max_sum
    ]
    random.Random(seed).shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows)
