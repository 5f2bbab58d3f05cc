"""Math answers compared with the ``math-verify`` library (LaTeX, boxed answers, numeric and symbolic equality).

math-verify's own time limits use ``signal.alarm`` and turn a timeout into ``False`` (a silent 0): they are
turned off here. A parse or comparison that runs too long is stopped by the verifier pool's per-call timeout,
which kills the worker and reports an explicit TIMEOUT result.
"""

from __future__ import annotations

import logging

from math_verify import parse, verify

from relayrl.reward.api import RewardInput, RewardResult

# math-verify warns once per process that its timeouts are off: the pool's timeout replaces them
logging.getLogger("math_verify").setLevel(logging.ERROR)


class UnparsableReference(ValueError):
    """The dataset's reference answer is not a math expression math-verify can read: a data error."""


def parse_reference(reference: str) -> list[object]:
    text = reference.strip()
    if not text:
        raise UnparsableReference("the dataset row has no reference answer")
    # a reference is a bare answer: read it as LaTeX math ("3\\pi" is 3*pi, not 3) unless it is delimited already
    delimited = "$" in text or "\\boxed" in text
    gold = parse(text if delimited else f"${text}$", parsing_timeout=None, raise_on_error=True)  # type: ignore[arg-type]
    if not gold and not delimited:
        gold = parse(text, parsing_timeout=None, raise_on_error=True)  # type: ignore[arg-type]
    if not gold:
        raise UnparsableReference(f"math-verify cannot parse the reference answer {text[:80]!r}")
    return list(gold)


def math_reward(
    inp: RewardInput, float_rounding: int = 6, numeric_precision: int = 15, strict: bool = True
) -> RewardResult:
    """1.0 when the completion's answer (the last ``\\boxed{}`` or LaTeX/plain expression math-verify finds)
    equals the reference, else 0.0. A completion with no answer scores 0 (the model's failure); an unparsable
    reference or an exception inside the comparison is an error (the verifier's failure)."""
    gold = parse_reference(inp.reference)
    answer = parse(inp.completion, parsing_timeout=None)  # type: ignore[arg-type]
    if not answer:
        return RewardResult(score=0.0, components={"correct": 0.0}, details="no answer found")
    correct = verify(
        gold,
        answer,
        float_rounding=float_rounding,
        numeric_precision=numeric_precision,
        strict=strict,
        timeout_seconds=None,
        raise_on_error=True,
    )
    score = 1.0 if correct else 0.0
    shown = answer[-1] if isinstance(answer[-1], str) else str(answer[0])
    return RewardResult(score=score, components={"correct": score}, details=f"answer {shown[:80]}")
