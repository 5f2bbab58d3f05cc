"""The second multi-turn tool example: an argument-free calculator bound to the episode's question, so that the
tool call needs no copying of arguments (examples/lookup_tools.yaml).

Prompt ``"47*86//10%10="`` (the tens digit of a product of two two-digit numbers), answer ``"4"``. The ideal episode
(tagged tool format, tool ``c``)::

    47*86//10%10=<c></c><r>4</r>4
                 ^ call ^ tool  ^ the model copies the tool's output

The call is a fixed string (loss mask 1); the environment evaluates the episode's own question (the tool's
keyword-only ``question``, bound by the tools workflow) and shows ``<r>4</r>`` (observation tokens, loss mask 0);
the model then copies the one digit, always at the same offset. The random-initialised model cannot compute the
answer itself (8100 questions, answers spread over the ten digits); it only has to learn a fixed string and a
one-token copy. Unlike the calculator example (relayrl.tasks.calculator), it does not learn to pass operands.
Reward (``WEIGHTS``), credit for each step: the first turn's correct prefix of the ideal call per character (none
for a whole call that got no result: see :func:`reward`), the call ran, the answer against the tool's output per
character, the answer against the reference per character; without a call at most ``WEIGHTS["answer"]`` (0.5), so
the 0.8 target needs the tool. The model's vocabulary must hold ``CHARS``:
``relayrl init-model --set chars='0123456789*/%=<>cr'``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from relayrl.reward.api import RewardInput, RewardResult
from relayrl.tasks.calculator import TOOL, _match, tool_output

CHARS = "0123456789*/%=<>cr"
CALL = f"<{TOOL}></{TOOL}>"
# Weights of the reward's parts: the call, the call ran, copying the tool's output, the correct answer (sum 1).
WEIGHTS = {"call": 0.2, "ran": 0.1, "copy": 0.2, "answer": 0.5}


def c(argument: str = "", *, question: str) -> str:
    """The result of the episode's question (``question``, bound by the workflow, e.g. "7*8="); takes no
    argument."""
    from relayrl.rollout.workflows.tools import calculator

    if argument.strip():
        raise ValueError("c takes no argument: it answers the episode's question")
    return calculator(question.strip().rstrip("="))


def _prefix(got: str, want: str) -> float:
    """The length of the longest common prefix of ``got`` and ``want``, over the longer of the two."""
    n = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return n / max(len(got), len(want), 1)


def reward(inp: RewardInput) -> RewardResult:
    """Credit for each step (weights ``WEIGHTS``): ``call``, the first turn's longest common prefix with
    ``<c></c>`` (per character: a character right after a wrong one earns nothing, so the only way up is the next
    character of the call); ``ran``, the call
    ran without an error; ``copy``, the final answer against the tool's output (0 without a call); ``answer``, the
    final answer against the reference; per character position where it applies. 1.0 only for the ideal episode.
    ``exact`` (not in the score): the final answer equals the reference."""
    answer = inp.reference.strip()
    if not answer:
        raise ValueError("the dataset row has no reference answer")
    transcript = str(inp.metadata.get("transcript", ""))
    close = f"</{TOOL}>"
    first_turn = transcript[: transcript.find(close) + len(close)] if close in transcript else transcript
    final = inp.completion.strip()
    shown = tool_output(transcript)
    # a whole call whose result never came: the episode had no room left for it, since the model spelled the call
    # with tokens the text does not show (a special token such as <unk> decodes to nothing); no credit, or RL
    # settles on such a call (seen in CI: "<c><unk></c>" every episode, never a tool result)
    unanswered = first_turn == CALL and shown is None
    parts = {
        "call": 0.0 if unanswered else _prefix(first_turn, CALL),
        "ran": float(shown is not None and not shown.startswith("error")),
        "copy": _match(final, shown) if shown is not None else 0.0,
        "answer": _match(final, answer),
    }
    score = sum(WEIGHTS[k] * v for k, v in parts.items())
    return RewardResult(score=score, components={**parts, "exact": float(final == answer)}, details=transcript[:64])


def make_dataset(path: Path, seed: int = 0, rows: int = 2000) -> int:
    """Write ``rows`` distinct ``a*b//10%10=`` prompts (the tens digit of a product of two two-digit numbers,
    10 <= a, b <= 99) with their one-digit results to ``path`` (JSONL), in a shuffled order; returns the count.
    Every episode has the same layout and the answer is one character, so the copy is one token at a fixed offset;
    the 8100 questions are beyond what the model memorises by RL in the budget, and their answers are spread over
    the ten digits (no digit is right for more than 12% of them)."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for a, b in pairs[:rows]:
            f.write(
                json.dumps({"id": f"{a}*{b}", "prompt": f"{a}*{b}//10%10=", "answer": str(a * b // 10 % 10)}) + "\n"
            )
    return min(rows, len(pairs))
