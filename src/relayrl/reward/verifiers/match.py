"""Text verifiers: exact or normalised match, regular expressions, and format (an answer inside a tag)."""

from __future__ import annotations

import re
import unicodedata

from relayrl.reward.api import RewardInput, RewardResult

_SPACE = re.compile(r"\s+")


def normalize_answer(text: str) -> str:
    """NFKC, case-folded, whitespace collapsed, surrounding quotes/``$`` and a trailing period removed."""
    text = unicodedata.normalize("NFKC", text).casefold().strip()
    text = _SPACE.sub(" ", text)
    for _ in range(2):
        text = text.strip().rstrip(".").strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'$`":
            text = text[1:-1]
    return text.strip()


def tagged(text: str, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>`` in ``text``, or None."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.S)
    return matches[-1] if matches else None


def exact_match(inp: RewardInput, normalize: bool = True, tag: str | None = None) -> RewardResult:
    """1.0 when the answer equals the reference: the whole completion, or the content of the last
    ``<tag>...</tag>`` when ``tag`` is set (no such tag: 0). ``normalize`` compares normalised text."""
    answer = inp.completion if tag is None else tagged(inp.completion, tag)
    if answer is None:
        return RewardResult(score=0.0, components={"match": 0.0}, details=f"no <{tag}> answer")
    if not inp.reference.strip():
        raise ValueError("the dataset row has no reference answer")
    same = (
        (normalize_answer(answer) == normalize_answer(inp.reference))
        if normalize
        else answer.strip() == inp.reference.strip()
    )
    score = 1.0 if same else 0.0
    return RewardResult(score=score, components={"match": score}, details=answer.strip()[:80])


def regex_match(
    inp: RewardInput, pattern: str | None = None, compare_reference: bool = False, fullmatch: bool = False
) -> RewardResult:
    """With ``compare_reference`` false: 1.0 when ``pattern`` (or the row's ``pattern`` metadata) matches the
    completion. With it true: 1.0 when the pattern's first group (or whole match) in the completion equals the
    reference after normalisation."""
    raw = pattern if pattern is not None else inp.metadata.get("pattern")
    if not isinstance(raw, str) or not raw:
        raise ValueError("regex_match needs a pattern (the `pattern` parameter or row metadata)")
    regex = re.compile(raw, flags=re.S)
    found = regex.fullmatch(inp.completion.strip()) if fullmatch else regex.search(inp.completion)
    if found is None:
        return RewardResult(score=0.0, components={"regex": 0.0}, details="no match")
    if not compare_reference:
        return RewardResult(score=1.0, components={"regex": 1.0}, details=found.group(0)[:80])
    value = found.group(1) if regex.groups else found.group(0)
    score = 1.0 if normalize_answer(value or "") == normalize_answer(inp.reference) else 0.0
    return RewardResult(score=score, components={"regex": score}, details=(value or "")[:80])


def format_reward(inp: RewardInput, tag: str = "answer", require_think: bool = False) -> RewardResult:
    """1.0 when the completion has a non-empty ``<tag>...</tag>`` (and, with ``require_think``, a
    ``<think>...</think>`` before it), else 0.0."""
    answer = tagged(inp.completion, tag)
    ok = answer is not None and bool(answer.strip())
    if ok and require_think:
        think = re.search(r"<think>.+?</think>", inp.completion, flags=re.S)
        ok = think is not None and think.end() <= inp.completion.rfind(f"<{tag}>")
    score = 1.0 if ok else 0.0
    return RewardResult(
        score=score,
        components={"format": score},
        details="formatted" if ok else f"missing <{tag}>" + (" or <think>" if require_think else ""),
    )
