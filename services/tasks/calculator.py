"""The multi-turn example task: single-digit multiplication that a tiny model learns to do with a calculator tool.

Prompt ``"7*8="``, answer ``"56"``. The ideal episode (tagged tool format, tool ``c``)::

    7*8=<c>7*8</c><r>56</r>56<eos>
        ^ model turn 1 ^ tool  ^ model turn 2 (copies the tool's output)

The model writes the call (loss mask 1), the tool's output comes back as observation tokens (loss mask 0), then
the model copies the result. Reward (components ``call``, ``answer``, ``exact``): half for the first turn's
match with the ideal call, half for the final answer's, each per character position (partial credit, as in
relayrl.tasks.arithmetic): 1.0 only for the ideal episode. The character vocabulary of the tiny model must hold
``CHARS``: ``relayrl init-model --set chars='0123456789+*=<>/cr'``. ``make_dataset`` also writes two-digit
additions (``op="+"``, operands 10 to 99), a harder variant.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from relayrl.reward.api import RewardInput, RewardResult

CHARS = "0123456789+*=<>/cr"
TOOL = "c"


def c(expression: str) -> str:
    """The calculator of the example (tool name ``c``): evaluates an arithmetic expression such as "12+35"."""
    from relayrl.rollout.workflows.tools import calculator

    return calculator(expression)


def _match(got: str, want: str) -> float:
    """Positions where ``got`` and ``want`` agree, over the longer of the two."""
    return sum(a == b for a, b in zip(got, want, strict=False)) / max(len(got), len(want), 1)


def ideal_call(prompt: str) -> str:
    return f"<{TOOL}>{prompt.rstrip('=')}</{TOOL}>"


def reward(inp: RewardInput) -> RewardResult:
    answer = inp.reference.strip()
    if not answer:
        raise ValueError("the dataset row has no reference answer")
    transcript = str(inp.metadata.get("transcript", ""))
    call = ideal_call(inp.prompt)
    first_turn = transcript[:transcript.find(f"</{TOOL}>") + len(f"</{TOOL}>")] if f"</{TOOL}>" in transcript \
        else transcript
    call_score = _match(first_turn, call)
    answer_score = _match(inp.completion.strip(), answer)
    exact = float(inp.completion.strip() == answer)
    return RewardResult(score=0.5 * call_score + 0.5 * answer_score,
                        components={"call": call_score, "answer": answer_score, "exact": exact},
                        details=transcript[:64])


def make_dataset(path: Path, low: int = 0, high: int = 9, rows: int = 2000, seed: int = 0, op: str = "*") -> int:
    """Write ``rows`` distinct ``a<op>b=`` prompts (op ``+`` or ``*``) with ``low <= a, b <= high`` to ``path``
    (JSONL); returns the count."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    rng.shuffle(pairs)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for a, b in pairs[:rows]:
            answer = a + b if op == "+" else a * b
            f.write(json.dumps({"id": f"{a}{op}{b}", "prompt": f"{a}{op}{b}=", "answer": str(answer)}) + "\n")
    return min(rows, len(pairs))
