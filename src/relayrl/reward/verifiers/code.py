"""Code: a Python completion run against test cases in the sandbox; score = fraction of tests passed.

Test cases come from the dataset row's metadata:

- ``tests``: a list of Python statements (typically asserts) run after the program in the same interpreter
  (see code_harness.py), all in one sandboxed run. An ``assert <expression> == <literal>`` (either side literal;
  or ``assert <expression> is None|True|False``) is a hidden-answer test: only the expression enters the sandbox,
  the program's value comes back as ``repr`` and is compared with the literal outside it (``ast.literal_eval``,
  no code run; code_judge.py);
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
claiming the right one is solving the test; exactly one well-formed report per test counts (code_judge.py says
what well-formed is). Other statements (``assert is_prime(7)``, ``assert abs(f(x) - y) < 1e-6``) are
self-reported by the harness and can be forged by a program written to do so: with ``reward.code.self_reported:
refuse`` (the default) a row with one is an error, naming the test, before anything runs; with ``trust`` they
count as reported and the result's details say how many were self-reported.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from relayrl.config.reward import CodeVerifierConfig, SelfReported
from relayrl.reward.api import RewardInput, RewardResult, runs_code
from relayrl.reward.sandbox import Sandbox, SandboxRun
from relayrl.reward.verifiers.code_judge import Test, judge_channel, split_test

HARNESS = (Path(__file__).parent / "code_harness.py").read_text()
_FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", flags=re.S)


def extract_program(completion: str) -> str:
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


class SelfReportedRefused(ValueError):
    """A row's tests include self-reported statements and ``reward.code.self_reported`` is ``refuse``."""


def _refuse_self_reported(tests: list[Test]) -> None:
    found = [(i, t.statement) for i, t in enumerate(tests) if not t.hidden]
    if found:
        i, statement = found[0]
        others = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise SelfReportedRefused(
            f"test {i} {statement[:120]!r}{others} is self-reported: only the harness inside the sandbox can report "
            "its verdict, and the program it runs with can forge that. Write it as `assert <expr> == <literal>` (its "
            "answer is then checked outside the sandbox), use io_tests, or set reward.code.self_reported: trust"
        )


def _assert_tests(sandbox: Sandbox, program: str, statements: list[str], policy: SelfReported) -> tuple[int, str, int]:
    """(passed, first error, self-reported tests)."""
    tests = [split_test(s) for s in statements]
    if policy is not SelfReported.TRUST:
        _refuse_self_reported(tests)  # before anything runs
    run = sandbox.run_python(
        "harness.py",
        {"harness.py": HARNESS, "program.py": program, "tests.json": json.dumps([t.payload for t in tests])},
    )
    verdicts = judge_channel(run.channel, tests, trust_self_reported=policy is SelfReported.TRUST)
    first_error = f"program failed: {verdicts.load_error}" if verdicts.load_error else ""
    if not first_error:
        first_error = next((f"test {i}: {why}" for i, why in enumerate(verdicts.why) if why and why != "no result"), "")
    if not run.ok and not first_error:
        first_error = f"program {run.describe()}: {run.stderr.decode(errors='replace').strip()[-200:]}"
    return verdicts.passed, first_error, sum(not t.hidden for t in tests)


def io_case_passes(run: SandboxRun, expected: str) -> bool:
    """An io case's verdict, decided outside the sandbox: the run ended by itself with exit status 0 (no kill, no
    output cap) and its stdout is ``expected`` (normalised). The channel and stderr play no part."""
    return run.ok and _normalize_output(run.stdout.decode(errors="replace")) == _normalize_output(expected)


def _io_tests(sandbox: Sandbox, program: str, cases: list[dict[str, Any]]) -> tuple[int, str]:
    budget = sandbox.cfg.total_timeout_s
    t0 = time.monotonic()
    passed, first_error = 0, ""
    for i, case in enumerate(cases):
        left = budget - (time.monotonic() - t0)
        if left < 0.2:
            first_error = first_error or f"time budget of {budget}s spent before case {i}"
            break
        run = sandbox.run_python(
            "program.py",
            {"program.py": program},
            stdin=str(case.get("input", "")).encode(),
            wall_timeout_s=min(sandbox.cfg.wall_timeout_s, left),
        )
        expected = str(case.get("output", ""))
        got = _normalize_output(run.stdout.decode(errors="replace"))
        if io_case_passes(run, expected):
            passed += 1
        elif not first_error:
            first_error = f"case {i}: " + (
                f"output {got[:60]!r} != {_normalize_output(expected)[:60]!r}"
                if run.ok
                else f"{run.describe()}: {run.stderr.decode(errors='replace')[-160:]}"
            )
    return passed, first_error


@runs_code
def code_reward(inp: RewardInput, *, sandbox: Sandbox, code_config: CodeVerifierConfig | None = None) -> RewardResult:
    """The fraction of the row's tests the completion's program passes, run in ``sandbox`` (the service's,
    passed by the scorer with ``code_config``, ``reward.code``; None: its defaults)."""
    policy = SelfReported((code_config or CodeVerifierConfig()).self_reported)
    tests = inp.metadata.get("tests")
    cases = inp.metadata.get("io_tests")
    if tests is None and cases is None:
        raise ValueError(
            "code_reward needs `tests` (Python statements) or `io_tests` (input/output pairs) in the row's metadata"
        )
    program = extract_program(inp.completion)
    if tests is not None:
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("metadata `tests` must be a non-empty list of strings")
        passed, why, self_reported = _assert_tests(sandbox, program, tests, policy)
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
    return RewardResult(
        score=score,
        components={"passed": score},
        details=f"{passed}/{total} tests passed" + (f"; {why}" if why else ""),
    )
