"""A sandboxed program cannot forge its code reward: the verdict of every hidden-answer test and io case is decided
outside the sandbox, and nothing the program writes (result channel, stdout, stderr, exit status) passes a test it
fails. Self-reported tests (only the in-sandbox harness can judge them) are refused by default."""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayrl.config.reward import CodeVerifierConfig, SandboxConfig, SelfReported
from relayrl.reward.api import RewardInput
from relayrl.reward.sandbox import Sandbox, SandboxRun
from relayrl.reward.verifiers.code import SelfReportedRefused, code_reward, io_case_passes
from relayrl.reward.verifiers.code_judge import Check, judge_channel, split_test

pytestmark = pytest.mark.security

ISSUE_TESTS = ["assert f(3) == 9", "assert f(4) == 16", "assert 1 == 2"]  # issue 31: scored 3/3 by forgery
SECRET = "s3cr3t-answer-7f2b"  # an expected value the generated channel contents never contain
SECRET_TESTS = [f"assert f(0) == {SECRET!r}", f"assert {SECRET!r} == g()", f"assert f(1) == [{SECRET!r}, -1]"]
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _lines(*rows: object) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


# -- judging level: channel bytes in, verdicts out (no sandbox) ---------------------------------------------------
def test_the_issue_attack_empty_errors_for_every_test_passes_nothing() -> None:
    tests = [split_test(s) for s in ISSUE_TESTS]

    verdicts = judge_channel(_lines(*({"test": i, "error": ""} for i in range(3))), tests)

    assert verdicts.passed == 0, verdicts.why


@pytest.mark.parametrize(
    "row",
    [
        {"test": 0, "value": "9", "error": ""},
        {"test": 0, "value": "9", "error": None},
        {"test": 0, "value": "9", "error": 0},
        {"test": 0, "value": "9", "error": False},
        {"test": 0, "value": "9", "error": []},
        {"test": 0, "error": ""},
        {"test": 0, "passed": True},
        {"test": 0, "value": "9", "passed": True},
        {"test": 0, "value": 9},
        {"test": 0, "value": None},
        {"test": 0},
        {"test": 0, "value": "f(3)"},
        {"test": 0, "value": "9", "extra": 1},
        {"test": 0, "value": ["9"]},
        {"test": False, "value": "9"},
        {"test": 0.0, "value": "9"},
        {"test": "0", "value": "9"},
        {"test": -3, "value": "9"},
        {"value": "9"},
        {"load_error": "", "test": 0, "value": "9"},
    ],
    ids=repr,
)
def test_a_malformed_report_of_the_right_value_fails_the_hidden_answer_test(row: dict[str, Any]) -> None:
    (test,) = [split_test("assert f(3) == 9")]

    assert judge_channel(_lines(row), [test]).passed == 0
    assert judge_channel(_lines({"test": 0, "value": "9"}), [test]).passed == 1  # the one well-formed shape


@pytest.mark.parametrize(
    "channel",
    [
        _lines({"test": 0, "value": "9"}, {"test": 0, "value": "9"}),  # the same claim twice
        _lines({"test": 0, "value": "9"}, {"test": 0, "value": "8"}),
        _lines({"test": 0, "value": "9"}, {"test": 0}),  # a second, malformed line also counts against it
        _lines({"test": 0, "value": "9"}, {"test": 0, "error": ""}),
    ],
    ids=["twice", "two-values", "plus-malformed", "plus-error"],
)
def test_more_than_one_report_for_a_test_fails_it(channel: bytes) -> None:
    assert judge_channel(channel, [split_test("assert f(3) == 9")]).passed == 0


def test_a_bool_index_is_not_an_index() -> None:
    tests = [split_test("assert f(3) == 9"), split_test("assert f(4) == 16")]

    verdicts = judge_channel(_lines({"test": True, "value": "16"}, {"test": False, "value": "9"}), tests)

    assert verdicts.why == ["no result", "no result"]


def test_non_json_non_dict_and_undecodable_lines_are_ignored_and_an_honest_report_still_passes() -> None:
    channel = (
        b'\xff\xfe garbage\n[1, 2]\n"str"\n{"test": 0\n' + b"[" * 100_000 + b"\n" + _lines({"test": 0, "value": "9"})
    )

    assert judge_channel(channel, [split_test("assert f(3) == 9")]).why == [""]


@pytest.mark.parametrize(
    ("statement", "value", "passes"),
    [
        ("assert f() == -1", "-1", True),
        ("assert -1 == f()", "-1", True),
        ("assert f() == (1, -2.5)", "(1, -2.5)", True),
        ("assert f() == {'a': [1, 2]}", "{'a': [1, 2]}", True),
        ("assert f() == 9, 'message'", "9", True),
        ("assert f() is None", "None", True),
        ("assert f() is None", "0", False),
        ("assert f() is True", "1", False),
        ("assert f() is False", "False", True),
        ("assert f() == 1 + 2j", "(1+2j)", True),
        ("assert f() == 9", "9.0", True),
        ("assert f() == '9'", "9", False),
    ],
    ids=repr,
)
def test_hidden_answer_forms_are_compared_outside_the_sandbox(statement: str, value: str, passes: bool) -> None:
    test = split_test(statement)

    assert test.hidden and "==" not in test.payload["expr"] and " is " not in test.payload["expr"]
    assert judge_channel(_lines({"test": 0, "value": value}), [test]).passed == int(passes)


@pytest.mark.parametrize(
    "statement",
    [
        "assert is_prime(7)",
        "assert f() != 3",
        "assert abs(f() - 1) < 1e-6",
        "x = f()",
        "assert f() == g()",
        "assert f() is not None",
        "f(",
        "assert 1 < f()",
    ],
)
def test_statements_that_cannot_hide_an_answer_are_self_reported_and_untrusted_by_default(statement: str) -> None:
    test = split_test(statement)

    assert test.check is Check.SELF_REPORTED
    assert judge_channel(_lines({"test": 0, "passed": True}), [test]).passed == 0
    assert judge_channel(_lines({"test": 0, "passed": True}), [test], trust_self_reported=True).passed == 1
    assert judge_channel(_lines({"test": 0, "passed": 1}), [test], trust_self_reported=True).passed == 0


# -- fuzzing the result channel ----------------------------------------------------------------------------------
KEYS = ["test", "value", "error", "passed", "load_error", "expr", "code", "extra"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["None", "True", "9", "[1]", "''", "(", "1e999"]),
)
json_values = scalars | st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=3),
    max_leaves=8,
)
# the shapes a forger would try, dense enough to be drawn often: an index of the tests (or one that only looks
# like it), and for each other key an edge value ("", None, 0, False, ...) half the time
index = st.integers(0, 2) | st.sampled_from([True, False, -1, 3, 1.0, "0", None])
edgy = st.sampled_from(["", None, 0, False, True, "9"]) | json_values
claims = st.fixed_dictionaries({"test": index}, optional={k: edgy for k in KEYS if k != "test"})
rows = claims | st.dictionaries(st.sampled_from(KEYS), json_values, max_size=5)
line = st.one_of(
    claims.map(lambda r: json.dumps(r).encode()),
    rows.map(lambda r: json.dumps(r).encode()),
    st.binary(max_size=40),
    json_values.map(lambda v: json.dumps(v).encode()),
)
channels = st.lists(line, max_size=12).map(lambda ls: b"\n".join(ls) + b"\n")


@FUZZ
@given(channel=channels, trust=st.booleans())
def test_no_channel_content_passes_a_hidden_answer_test_it_does_not_know(channel: bytes, trust: bool) -> None:
    tests = [split_test(s) for s in SECRET_TESTS]
    assert all(t.hidden for t in tests)

    assert judge_channel(channel, tests, trust_self_reported=trust).passed == 0


@FUZZ
@given(
    claim=st.fixed_dictionaries({"test": st.just(0)}, optional={k: edgy for k in KEYS if k != "test"}),
    noise=st.lists(line, max_size=4).map(lambda ls: b"\n".join(ls) + b"\n"),
    trust=st.booleans(),
)
def test_no_single_report_passes_a_hidden_answer_test_it_does_not_know(
    claim: dict[str, Any], noise: bytes, trust: bool
) -> None:
    tests = [split_test(s) for s in SECRET_TESTS]

    assert judge_channel(noise + _lines(claim), tests, trust_self_reported=trust).passed == 0


@FUZZ
@given(
    extra=st.dictionaries(
        st.sampled_from([k for k in KEYS if k not in ("test", "value")]), json_values, min_size=1, max_size=3
    ),
    repeats=st.integers(1, 3),
    noise=channels,
)
def test_the_right_value_with_any_other_key_or_repeated_never_passes(
    extra: dict[str, Any], repeats: int, noise: bytes
) -> None:
    test = split_test("assert f(3) == 9")
    forged = _lines(*[{"test": 0, "value": "9", **extra}] + [{"test": 0, "value": "9"}] * (repeats - 1))

    assert judge_channel(noise + forged, [test]).passed == 0


@FUZZ
@given(
    noise=st.lists(
        st.one_of(
            st.binary(max_size=40),
            rows.filter(lambda r: type(r.get("test")) is not int).map(lambda r: json.dumps(r).encode()),
        ),
        max_size=8,
    )
)
def test_one_honest_report_passes_whatever_else_is_on_the_channel(noise: list[bytes]) -> None:
    channel = b"\n".join([*noise, json.dumps({"test": 0, "value": "9"}).encode()]) + b"\n"

    assert judge_channel(channel, [split_test("assert f(3) == 9")]).why == [""]


def _run(
    stdout: bytes,
    exit_code: int | None = 0,
    timed_out: bool = False,
    exceeded: bool = False,
    stderr: bytes = b"",
    channel: bytes = b"",
) -> SandboxRun:
    return SandboxRun(exit_code, stdout, stderr, channel, timed_out, exceeded, 0.1)


@FUZZ
@given(
    stdout=st.binary(max_size=64),
    stderr=st.binary(max_size=64),
    channel=channels,
    exit_code=st.one_of(st.none(), st.integers(-9, 255)),
    timed_out=st.booleans(),
    exceeded=st.booleans(),
)
def test_nothing_a_run_writes_or_exits_with_passes_an_io_case_it_does_not_know(
    stdout: bytes, stderr: bytes, channel: bytes, exit_code: int | None, timed_out: bool, exceeded: bool
) -> None:
    assert not io_case_passes(_run(stdout, exit_code, timed_out, exceeded, stderr, channel), SECRET)


@pytest.mark.parametrize(
    ("run", "passes"),
    [
        (_run(SECRET.encode() + b"  \n\n"), True),
        (_run(SECRET.encode(), exit_code=1), False),
        (_run(SECRET.encode(), exit_code=None, timed_out=True), False),
        (_run(SECRET.encode(), exceeded=True), False),
        (_run(b"", stderr=SECRET.encode()), False),
        (_run(b"", channel=_lines({"test": 0, "passed": True})), False),
    ],
)
def test_an_io_case_passes_only_on_its_output_from_a_clean_exit(run: SandboxRun, passes: bool) -> None:
    assert io_case_passes(run, SECRET + "\n") is passes


# -- the verifier: self-reported tests refused before anything runs ---------------------------------------------
class CountingSandbox(Sandbox):
    """A sandbox that counts the runs it is asked for and runs none."""

    def __init__(self) -> None:
        super().__init__(SandboxConfig())
        self.runs = 0

    def run_python(self, *args: Any, **kwargs: Any) -> SandboxRun:
        self.runs += 1
        return _run(b"")


def _inp(program: str, tests: list[str]) -> RewardInput:
    return RewardInput(prompt="", completion=program, reference="", metadata={"tests": tests})


def test_a_row_with_a_self_reported_test_is_refused_by_default_naming_it_before_anything_runs() -> None:
    sandbox = CountingSandbox()

    with pytest.raises(
        SelfReportedRefused,
        match=r"test 1 'assert is_prime\(7\)'.*assert <expr> == <literal>.*"
        r"io_tests.*reward\.code\.self_reported: trust",
    ):
        code_reward(
            _inp("def is_prime(n):\n    return True\n", ["assert f(3) == 9", "assert is_prime(7)"]), sandbox=sandbox
        )
    assert sandbox.runs == 0
    code_reward(_inp("", ["assert f(3) == 9"]), sandbox=sandbox)
    assert sandbox.runs == 1  # a row of hidden-answer tests only does run


# -- real sandboxed runs ---------------------------------------------------------------------------------------
def _score_here(program: str, tests: list[str], policy: SelfReported) -> tuple[float, str]:
    sandbox = Sandbox(SandboxConfig(wall_timeout_s=4.0, total_timeout_s=8.0))
    result = code_reward(_inp(program, tests), sandbox=sandbox, code_config=CodeVerifierConfig(policy))
    return result.score, result.details


@pytest.fixture(scope="module")
def verifier_process() -> Iterator[ProcessPoolExecutor]:
    """A spawned process runs the verifier, as the service does (see test_code_sandbox.py for why)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def _forger(lines: list[dict[str, object]]) -> str:
    payload = "".join(json.dumps(row) + "\n" for row in lines)
    return f"import os\nos.write(3, {payload.encode()!r})\nos._exit(0)\n"


def test_the_issue_forger_in_the_real_sandbox_scores_zero(verifier_process: ProcessPoolExecutor) -> None:
    program = _forger([{"test": i, "error": ""} for i in range(len(ISSUE_TESTS))])

    score, details = verifier_process.submit(_score_here, program, ISSUE_TESTS, SelfReported.REFUSE).result(60)

    assert score == 0.0, details


def test_a_forger_of_error_free_passes_scores_zero_on_trusted_self_reported_tests_too(
    verifier_process: ProcessPoolExecutor,
) -> None:
    rows: list[dict[str, object]] = [
        {"test": 0, "error": None},
        {"test": True, "value": "16"},
        {"test": 2, "passed": True, "error": False},
    ]
    tests = ["assert f(3) == 9", "assert f(4) == 16", "assert is_prime(7)"]

    score, details = verifier_process.submit(_score_here, _forger(rows), tests, SelfReported.TRUST).result(60)
    honest, _ = verifier_process.submit(
        _score_here, "def f(x):\n    return x * x\ndef is_prime(n):\n    return True\n", tests, SelfReported.TRUST
    ).result(60)

    assert score == 0.0, details
    assert honest == 1.0
