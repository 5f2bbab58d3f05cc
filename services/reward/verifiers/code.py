"""Code: a Python completion run against test cases in the sandbox; score = fraction of tests passed.

Test cases come from the dataset row's metadata:

- ``tests``: a list of Python statements (typically asserts) run after the program in the same interpreter
  (see code_harness.py), all in one sandboxed run. An ``assert <expression> == <literal>`` (either side literal)
  is a hidden-answer test: only the expression enters the sandbox, the program's value comes back as ``repr``
  and is compared with the literal outside it (``ast.literal_eval``, no code run);
- ``io_tests``: a list of ``{"input": str, "output": str}``; the program runs once per case with the input on
  stdin, and its stdout is compared (trailing whitespace of lines and trailing blank lines ignored) outside the
  sandbox.

The program is the last fenced code block of the completion (```python, ```py or ```), else the whole
completion. A program that fails, hangs, exceeds a limit or prints too much fails the affected tests: that is
the model's failure and a real score. A sandbox that cannot run at all, or a row without tests, is the
verifier's failure and an error result.

Forgery: the program shares an interpreter with the harness, so whatever the harness reports can be written by
the program (fd 3 is in reach, builtins can be patched). Hidden-answer tests and ``io_tests`` are therefore
judged outside the sandbox against answers the program never sees: a forged line can only claim a value, and
claiming the right one is solving the test. One line per test counts; a second line for the same test fails
it. Other statements (``assert is_prime(7)``, ``assert abs(f(x) - y) < 1e-6``) are self-reported by the
harness and can be forged by a program written to do so; the result's details count them.
"""

from __future__ import annotations

import ast
import json
import re
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Test:
    """One ``tests`` entry as the sandbox sees it (``payload``) and what stays outside (``expected``)."""

    payload: dict[str, str]
    expected: Any = None
    hidden: bool = False


def _split_test(statement: str) -> _Test:
    """``assert X == <literal>`` (or ``<literal> == X``) becomes a hidden-answer test; anything else runs as is."""
    try:
        tree = ast.parse(statement)
    except SyntaxError:
        return _Test({"code": statement})
    node = tree.body[0] if len(tree.body) == 1 else None
    if isinstance(node, ast.Assert) and node.msg is None and isinstance(node.test, ast.Compare) \
            and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq):
        left, right = node.test.left, node.test.comparators[0]
        for expr, literal in ((left, right), (right, left)):
            try:
                expected = ast.literal_eval(literal)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            return _Test({"expr": ast.unparse(expr)}, expected, hidden=True)
    return _Test({"code": statement})


def _judge(test: _Test, row: dict[str, Any]) -> str:
    """Empty when ``row`` (the harness's report) passes ``test``, else why not."""
    if "error" in row:
        return str(row["error"])
    if not test.hidden:
        return "" if row.get("passed") is True else "no result"
    try:
        value = ast.literal_eval(str(row.get("value")))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return f"the result {str(row.get('value'))[:60]!r} is not a literal value"
    return "" if value == test.expected else \
        f"got {str(row.get('value'))[:60]}, expected {test.expected!r}"[:200]


def _assert_tests(sandbox: Sandbox, program: str, statements: list[str]) -> tuple[int, str, int]:
    """(passed, first error, self-reported tests)."""
    tests = [_split_test(s) for s in statements]
    run = sandbox.run_python("harness.py", {"harness.py": HARNESS, "program.py": program,
                                            "tests.json": json.dumps([t.payload for t in tests])})
    reports: dict[int, dict[str, Any] | None] = {}  # None: reported twice (tampering): failed
    first_error = ""
    for line in run.channel.decode(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict):
            continue
        if "load_error" in row:
            first_error = first_error or f"program failed: {row['load_error']}"
        elif isinstance(row.get("test"), int) and 0 <= row["test"] < len(tests):
            reports[row["test"]] = None if row["test"] in reports else row
    passed = 0
    for i, test in enumerate(tests):
        row = reports.get(i)
        why = "reported twice" if i in reports and row is None else ("no result" if row is None else _judge(test, row))
        passed += not why
        if why and not first_error and i in reports:
            first_error = f"test {i}: {why}"
    if not run.ok and not first_error:
        first_error = f"program {run.describe()}: {run.stderr.decode(errors='replace').strip()[-200:]}"
    return passed, first_error, sum(not t.hidden for t in tests)


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
        passed, why, self_reported = _assert_tests(sandbox, program, tests)
        total = len(tests)
        if self_reported:
            why = f"{why}; " if why else ""
            why += f"{self_reported} of {total} tests self-reported by the harness"
    else:
        if not isinstance(cases, list) or not cases or not all(isinstance(c, dict) for c in cases):
            raise ValueError("metadata `io_tests` must be a non-empty list of {input, output} objects")
        passed, why = _io_tests(sandbox, program, cases)
        total = len(cases)
    score = passed / total
    return RewardResult(score=score, components={"passed": score},
                        details=f"{passed}/{total} tests passed" + (f"; {why}" if why else ""))
