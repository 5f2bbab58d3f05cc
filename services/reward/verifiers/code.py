"""Code: a Python completion run against test cases in the sandbox; score = fraction of tests passed.

Test cases come from the dataset row's metadata:

- ``tests``: a list of Python statements (typically asserts) run after the program in the same interpreter
  (see code_harness.py), all in one sandboxed run;
- ``io_tests``: a list of ``{"input": str, "output": str}``; the program runs once per case with the input on
  stdin, and its stdout is compared (trailing whitespace of lines and trailing blank lines ignored) outside the
  sandbox.

The program is the last fenced code block of the completion (```python, ```py or ```), else the whole
completion. A program that fails, hangs, exceeds a limit or prints too much fails the affected tests: that is
the model's failure and a real score. A sandbox that cannot run at all, or a row without tests, is the
verifier's failure and an error result.

Limits: with ``tests``, the program shares an interpreter with the harness, so a program written to attack it
(writing a forged result line to fd 3, patching builtins) can fake passes; ``io_tests`` are judged outside the
sandbox and cannot be forged that way.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from relayrl.reward.api import RewardInput, RewardResult
from relayrl.reward.sandbox import Sandbox

HARNESS = (Path(__file__).parent / "code_harness.py").read_text()
_FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", flags=re.S)


def extract_program(completion: str) -> str:
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


def _assert_tests(sandbox: Sandbox, program: str, tests: list[str]) -> tuple[int, str]:
    run = sandbox.run_python("harness.py", {"harness.py": HARNESS, "program.py": program,
                                            "tests.json": json.dumps(tests)})
    passed, first_error = 0, ""
    for line in run.channel.decode(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "load_error" in row:
            first_error = f"program failed: {row['load_error']}"
        elif row.get("passed") is True:
            passed += 1
        elif not first_error:
            first_error = f"test {row.get('test')}: {row.get('error')}"
    if not run.ok and not first_error:
        first_error = f"program {run.describe()}: {run.stderr.decode(errors='replace').strip()[-200:]}"
    return min(passed, len(tests)), first_error


def _io_tests(sandbox: Sandbox, program: str, cases: list[dict[str, Any]]) -> tuple[int, str]:
    budget = sandbox.cfg.total_timeout_s
    t0 = time.monotonic()
    passed, first_error = 0, ""
    for i, case in enumerate(cases):
        left = budget - (time.monotonic() - t0)
        if left < 0.2:
            first_error = first_error or f"time budget of {budget}s spent before case {i}"
            break
        run = sandbox.run_python("program.py", {"program.py": program}, stdin=str(case.get("input", "")).encode(),
                                 wall_timeout_s=min(sandbox.cfg.wall_timeout_s, left))
        expected = _normalize_output(str(case.get("output", "")))
        got = _normalize_output(run.stdout.decode(errors="replace"))
        if run.ok and got == expected:
            passed += 1
        elif not first_error:
            first_error = f"case {i}: " + (f"output {got[:60]!r} != {expected[:60]!r}" if run.ok
                                           else f"{run.describe()}: {run.stderr.decode(errors='replace')[-160:]}")
    return passed, first_error


def code_reward(inp: RewardInput, *, sandbox: Sandbox) -> RewardResult:
    """The fraction of the row's tests the completion's program passes, run in ``sandbox`` (the service's,
    passed by the scorer)."""
    tests = inp.metadata.get("tests")
    cases = inp.metadata.get("io_tests")
    if tests is None and cases is None:
        raise ValueError("code_reward needs `tests` (Python statements) or `io_tests` (input/output pairs) "
                         "in the row's metadata")
    program = extract_program(inp.completion)
    if tests is not None:
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("metadata `tests` must be a non-empty list of strings")
        passed, why = _assert_tests(sandbox, program, tests)
        total = len(tests)
    else:
        if not isinstance(cases, list) or not cases or not all(isinstance(c, dict) for c in cases):
            raise ValueError("metadata `io_tests` must be a non-empty list of {input, output} objects")
        passed, why = _io_tests(sandbox, program, cases)
        total = len(cases)
    score = passed / total
    return RewardResult(score=score, components={"passed": score},
                        details=f"{passed}/{total} tests passed" + (f"; {why}" if why and passed < total else ""))
