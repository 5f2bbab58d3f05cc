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
TAGGED_OPEN, TAGGED_CLOSE = "<r>", "</r>"  # how the tagged format shows a tool's output (rollout.workflows.tools)
# Weights of the reward's parts: the call, the call ran, copying the tool's output, the correct answer (sum 1).
WEIGHTS = {"call": 0.2, "ran": 0.1, "copy": 0.2, "answer": 0.5}


def c(expression: str) -> str:
    """The calculator of the example (tool name ``c``): evaluates an arithmetic expression such as "12+35"."""
    from relayrl.rollout.workflows.tools import calculator

    return calculator(expression)


def _match(got: str, want: str) -> float:
    """Positions where ``got`` and ``want`` agree, over the longer of the two."""
    return sum(a == b for a, b in zip(got, want, strict=False)) / max(len(got), len(want), 1)


def ideal_call(prompt: str) -> str:
    return f"<{TOOL}>{prompt.rstrip('=')}</{TOOL}>"


def tool_output(transcript: str) -> str | None:
    """The output the tool showed after the episode's first call (the observation right after ``</c>``), or None
    when the model made no call."""
    close = f"</{TOOL}>"
    end = transcript.find(close)
    if end < 0:
        return None
    rest = transcript[end + len(close) :]
    if not rest.startswith(TAGGED_OPEN) or TAGGED_CLOSE not in rest:
        return None
    return rest[len(TAGGED_OPEN) : rest.index(TAGGED_CLOSE)]


def reward(inp: RewardInput) -> RewardResult:
    """Credit for each step of the behaviour (weights ``WEIGHTS``): ``call``, the first turn against the ideal
    call; ``ran``, 1 when the first call ran without an error (whatever its operands); ``copy``, the final answer
    against the output the tool showed (0 without a call); ``answer``, the final answer against the reference;
    each per character position where it applies. 1.0 only for the ideal episode: with the ideal
    call the tool shows the reference, so the copy and the answer agree. ``exact`` (not in the score): the final
    answer equals the reference."""
    answer = inp.reference.strip()
    if not answer:
        raise ValueError("the dataset row has no reference answer")
    transcript = str(inp.metadata.get("transcript", ""))
    call = ideal_call(inp.prompt)
    close = f"</{TOOL}>"
    first_turn = transcript[: transcript.find(close) + len(close)] if close in transcript else transcript
    final = inp.completion.strip()
    shown = tool_output(transcript)
    parts = {
        "call": _match(first_turn, call),
        "ran": float(shown is not None and not shown.startswith("error")),
        "copy": _match(final, shown) if shown is not None else 0.0,
        "answer": _match(final, answer),
    }
    score = sum(WEIGHTS[k] * v for k, v in parts.items())
    return RewardResult(score=score, components={**parts, "exact": float(final == answer)}, details=transcript[:64])


def make_dataset(
    path: Path, low: int = 2, high: int = 9, rows: int = 2000, seed: int = 0, op: str = "*", width: int = 2
) -> int:
    """Write ``rows`` distinct ``a<op>b=`` prompts (op ``+`` or ``*``) with ``low <= a, b <= high`` whose result has
    ``width`` digits (0: any) to ``path`` (JSONL); returns the count. The defaults (58 products of 2 to 9 from 10 to
    81) give every episode the same layout, so each copy the model learns is at a fixed offset."""
    rng = random.Random(seed)
    result = (lambda a, b: a + b) if op == "+" else (lambda a, b: a * b)
    pairs = [
        (a, b)
        for a in range(low, high + 1)
        for b in range(low, high + 1)
        if not width or len(str(result(a, b))) == width
    ]
    rng.shuffle(pairs)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for a, b in pairs[:rows]:
            f.write(json.dumps({"id": f"{a}{op}{b}", "prompt": f"{a}{op}{b}=", "answer": str(result(a, b))}) + "\n")
    return min(rows, len(pairs))
