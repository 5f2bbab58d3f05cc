"""`judge`: a language model grades each completion through an OpenAI-compatible chat endpoint (the run's own
inference, another relayrl inference, vLLM, or any server that speaks ``/v1/chat/completions``).

The rubric is a template of the row's ``{prompt}``, ``{completion}``, ``{reference}`` and metadata fields; the
judge's reply must hold its grade where ``score_pattern``'s first group finds it: a number, scaled from
[min_score, max_score] to [0, 1], or a verdict whose value ``labels`` gives (``{"yes": 1, "no": 0}``). The parse
refuses rather than guesses: no grade, two different grades, an unknown verdict or a grade out of range is not a
score. A call that fails (connection, timeout, HTTP 408, 429 or 5xx) is tried again up to ``attempts`` times, an
unparsable reply too when the judge samples (temperature > 0: a greedy judge would answer the same); what still
fails is that completion's ERROR result (counted in the reward service's errors), never a 0. The chunk's
completions are judged concurrently (``concurrency`` calls at once).

An API key comes from the environment variable ``api_key_env`` names (never from the config).
"""

from __future__ import annotations

import json
import os
import re
import string
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from relayrl.reward.api import RewardInput, RewardResult, batched

DEFAULT_RUBRIC = (
    "Grade the answer to the question against the reference answer.\n\n"
    "Question: {prompt}\n\nReference answer: {reference}\n\nAnswer to grade: {completion}\n\n"
    "Reply with one line: SCORE: N, where N is a whole number from 0 (wrong) to 10 (correct and complete)."
)
DEFAULT_PATTERN = r"SCORE:\s*(-?\d+(?:\.\d+)?)"
RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class JudgeError(RuntimeError):
    """A judgement that cannot become a score: the call failed or the reply holds no single valid grade."""


def parse_grade(reply: str, pattern: str, low: float, high: float, labels: dict[str, float] | None = None) -> float:
    """The one grade ``reply`` holds, scaled to [0, 1] (with ``labels``: the value of the one verdict it holds, e.g.
    ``{"yes": 1, "no": 0}``, matched case-insensitively); :class:`JudgeError` when it holds none, two different
    ones, an unknown verdict, or a grade outside [low, high]."""
    if labels:
        verdicts = {m.group(1).lower() for m in re.finditer(pattern, reply, re.IGNORECASE)}
        unknown = sorted(verdicts - {k.lower() for k in labels})
        if unknown or len(verdicts) != 1:
            why = f"unknown verdicts {unknown}" if unknown else f"{len(verdicts)} verdicts"
            raise JudgeError(f"{why} in the judge's reply ({reply[:200]!r})")
        return float({k.lower(): v for k, v in labels.items()}[verdicts.pop()])
    found = {float(m.group(1)) for m in re.finditer(pattern, reply)}
    if not found:
        raise JudgeError(f"no grade in the judge's reply ({reply[:200]!r})")
    if len(found) > 1:
        raise JudgeError(f"the judge's reply holds different grades {sorted(found)}")
    (grade,) = found
    if not low <= grade <= high:
        raise JudgeError(f"grade {grade:g} is outside [{low:g}, {high:g}]")
    return (grade - low) / (high - low)


def render(rubric: str, inp: RewardInput, max_chars: int) -> str:
    """The rubric with the row's fields filled in; a field the row lacks, or a result over ``max_chars``, is an
    error of this completion."""
    values = {**{str(k): v for k, v in inp.metadata.items()}, "prompt": inp.prompt}
    values.update(completion=inp.completion, reference=inp.reference)
    names = {name for _, name, _, _ in string.Formatter().parse(rubric) if name}
    missing = sorted(names - set(values))
    if missing:
        raise JudgeError(f"the rubric names {missing}, which the row does not have")
    text = rubric.format_map(values)
    if len(text) > max_chars:
        raise JudgeError(f"the rubric filled in is {len(text)} characters, over max_prompt_chars ({max_chars})")
    return text


def _ask(url: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float) -> str:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        reply = json.loads(response.read())
    try:
        return str(reply["choices"][0]["message"]["content"] or "")
    except (KeyError, IndexError, TypeError):
        raise JudgeError(f"not a chat completion: {str(reply)[:200]}") from None


def _api_key(api_key_env: str) -> dict[str, str]:
    if not api_key_env:
        return {}
    key = os.environ.get(api_key_env, "")
    if not key:
        raise JudgeError(f"the judge's API key variable {api_key_env} is not set")
    return {"Authorization": f"Bearer {key}"}


def judge_one(inp: RewardInput, settings: dict[str, Any]) -> RewardResult:
    """One completion judged, with retries; :class:`JudgeError` when every attempt failed."""
    s = settings
    body = {
        "messages": [{"role": "user", "content": render(s["rubric"], inp, s["max_prompt_chars"])}],
        "max_tokens": s["max_tokens"],
        "temperature": s["temperature"],
        **({"model": s["model"]} if s["model"] else {}),
    }
    url = s["endpoint"].rstrip("/") + "/chat/completions"
    failures: list[str] = []
    for attempt in range(s["attempts"]):
        if attempt:
            time.sleep(min(2.0, 0.2 * 2**attempt))
        try:
            reply = _ask(url, body, _api_key(s["api_key_env"]), s["timeout_s"])[: s["max_reply_chars"]]
            grade = parse_grade(reply, s["score_pattern"], s["min_score"], s["max_score"], s["labels"])
            raw = grade if s["labels"] else grade * (s["max_score"] - s["min_score"]) + s["min_score"]
            return RewardResult(grade, {"grade": raw}, reply)
        except urllib.error.HTTPError as exc:
            failures.append(f"HTTP {exc.code}")
            if exc.code not in RETRY_STATUS:
                break
        except JudgeError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            if not s["temperature"]:  # a greedy judge answers the same again
                break
        except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
    raise JudgeError(f"no judgement after {len(failures)} attempts: {'; '.join(failures)}")


@batched
def judge(
    inputs: list[RewardInput],
    *,
    endpoint: str,
    model: str = "",
    rubric: str = DEFAULT_RUBRIC,
    score_pattern: str = DEFAULT_PATTERN,
    labels: dict[str, float] | None = None,
    min_score: float = 0.0,
    max_score: float = 10.0,
    max_tokens: int = 32,
    temperature: float = 0.0,
    attempts: int = 3,
    timeout_s: float = 30.0,
    concurrency: int = 8,
    max_prompt_chars: int = 16_000,
    max_reply_chars: int = 4_000,
    api_key_env: str = "",
) -> list[RewardResult | BaseException]:
    """Each completion's grade from the judge model at ``endpoint`` (an OpenAI-compatible base URL, ``.../v1``)."""
    if not endpoint.startswith(("http://", "https://")):
        raise JudgeError(f"endpoint {endpoint!r} must be an http(s) base URL such as http://host:8000/v1")
    if not max_score > min_score or attempts < 1 or concurrency < 1 or re.compile(score_pattern).groups < 1:
        raise JudgeError("judge needs max_score > min_score, attempts >= 1, concurrency >= 1, a pattern with a group")
    settings = dict(locals())
    del settings["inputs"]

    def one(inp: RewardInput) -> RewardResult | BaseException:
        try:
            return judge_one(inp, settings)
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(concurrency, len(inputs) or 1)) as pool:
        return list(pool.map(one, inputs))
