"""The code verifier's ``tests`` judged outside the sandbox: which tests hide their answer, and what the harness's
result channel (fd 3) says about each.

The program shares its interpreter with the harness (code_harness.py), so everything on the channel may have been
written by the program. The channel can therefore only *claim* values; the verdict is decided here:

- a hidden-answer test (``assert <expr> == <literal>``, ``assert <literal> == <expr>``, ``assert <expr> is
  None|True|False``; an assert message is ignored) sends only ``<expr>`` into the sandbox. It passes only when
  exactly one report for it arrived, of exactly the shape ``{"test": <int index>, "value": <str>}``, whose value
  ``ast.literal_eval``-uates equal to the literal (``is`` for the singletons). Claiming the right value is
  solving the test. Anything else fails it: an ``error`` key whatever its value, a missing, non-string or
  unparsable value, another key, a second report (even an identical one);
- any other statement is self-reported: only the harness can say it ran without raising, so a program written to
  do so can forge it. It passes only on exactly one ``{"test": i, "passed": true}`` (when the service trusts such
  tests at all: ``reward.code.self_reported``).

Lines that are not JSON objects, indices that are not plain ints (``true`` is not ``1``) or are out of range are
ignored: they can never make a test pass.
"""

from __future__ import annotations

import ast
import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_VALUE_CHARS = 100_000  # the harness's own cap of a reported repr
_LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)
SINGLETONS = (None, True, False)


class Check(enum.Enum):
    EQUAL = "=="  # the reported value == the literal
    IDENTICAL = "is"  # the reported value is None / True / False
    SELF_REPORTED = "self-reported"  # the harness reports passed or an error


@dataclass(frozen=True)
class Test:
    """One ``tests`` entry: what the sandbox sees (``payload``) and what stays outside (``expected``)."""

    statement: str
    payload: dict[str, str]
    check: Check = Check.SELF_REPORTED
    expected: Any = None

    @property
    def hidden(self) -> bool:
        return self.check is not Check.SELF_REPORTED


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except _LITERAL_ERRORS:
        return False, None


def split_test(statement: str) -> Test:
    """A hidden-answer test when ``statement`` is one assert comparing an expression with a literal, else a
    self-reported one that runs as is."""
    self_reported = Test(statement, {"code": statement})
    try:
        tree = ast.parse(statement)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return self_reported
    node = tree.body[0] if len(tree.body) == 1 else None
    if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1):
        return self_reported
    op, left, right = node.test.ops[0], node.test.left, node.test.comparators[0]
    if isinstance(op, ast.Eq):
        for expr, literal in ((left, right), (right, left)):
            ok, expected = _literal(literal)
            if ok:
                return Test(statement, {"expr": ast.unparse(expr)}, Check.EQUAL, expected)
    if isinstance(op, ast.Is) and isinstance(right, ast.Constant) and any(right.value is s for s in SINGLETONS):
        return Test(statement, {"expr": ast.unparse(left)}, Check.IDENTICAL, right.value)
    return self_reported


@dataclass(frozen=True)
class Channel:
    """The channel's lines that name a test, by index (every line naming it, well-formed or not), and the first
    ``load_error`` (the program failed to load: for the details only)."""

    reports: dict[int, list[dict[str, Any]]]
    load_error: str = ""


def read_channel(data: bytes, n_tests: int) -> Channel:
    reports: dict[int, list[dict[str, Any]]] = {}
    load_error = ""
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (ValueError, RecursionError, MemoryError):  # not JSON, not UTF-8, too deep
            continue
        if not isinstance(row, dict):
            continue
        if "test" not in row:
            if not load_error and isinstance(row.get("load_error"), str):
                load_error = row["load_error"][:300] or "the program failed to load"
            continue
        index = row["test"]
        if type(index) is int and 0 <= index < n_tests:  # exactly int: a bool is an int, and no index
            reports.setdefault(index, []).append(row)
    return Channel(reports, load_error)


def _short(value: object) -> str:
    return str(value)[:60]


def judge(test: Test, rows: Sequence[dict[str, Any]], trust_self_reported: bool) -> str:
    """Empty when ``rows`` (every channel line for this test) pass ``test``, else why not."""
    if not rows:
        return "no result"
    if len(rows) > 1:
        return f"reported twice or more ({len(rows)} reports): tampering"
    row = rows[0]
    if "error" in row:
        return _short(row["error"]) or f"error {row['error']!r}"
    if not test.hidden:
        if not trust_self_reported:
            return "self-reported test, not trusted (reward.code.self_reported: refuse)"
        return "" if set(row) == {"test", "passed"} and row["passed"] is True else "no pass reported"
    value = row.get("value")
    if set(row) != {"test", "value"} or not isinstance(value, str):
        return "malformed report"
    if len(value) > MAX_VALUE_CHARS:
        return "the result is too long"
    try:
        got = ast.literal_eval(value)
        same = got is test.expected if test.check is Check.IDENTICAL else (got == test.expected) is True
    except _LITERAL_ERRORS:
        return f"the result {_short(value)!r} is not a literal value"
    return "" if same else f"got {_short(value)}, expected {test.expected!r}"[:200]


@dataclass(frozen=True)
class Verdicts:
    """What a run's channel earned: one reason per test (empty: passed), and the program's load error."""

    why: list[str]
    load_error: str = ""

    @property
    def passed(self) -> int:
        return sum(not w for w in self.why)


def judge_channel(data: bytes, tests: Sequence[Test], trust_self_reported: bool = False) -> Verdicts:
    """Every test's verdict from the raw bytes of the result channel."""
    channel = read_channel(data, len(tests))
    why = [judge(t, channel.reports.get(i, []), trust_self_reported) for i, t in enumerate(tests)]
    return Verdicts(why, channel.load_error)
