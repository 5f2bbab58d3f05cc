"""Model-written code cannot forge its own test results, and the `process` sandbox backend never runs code as the
service's own user."""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest

from relayrl.config.reward import CodeVerifierConfig, SandboxBackend, SandboxConfig, SelfReported
from relayrl.reward.api import RewardInput
from relayrl.reward.sandbox import Sandbox, SandboxUnavailable
from relayrl.reward.verifiers.code import code_reward

pytestmark = pytest.mark.security

SANDBOX = Sandbox(SandboxConfig(wall_timeout_s=4.0, total_timeout_s=8.0))
TESTS = ["assert solve(2) == 4", "assert solve(3) == 9", "assert 16 == solve(4)"]


Verify = Callable[..., tuple[float, str]]  # (program, tests, trust self-reported=False) -> (score, details)


def _score_here(program: str, tests: list[str], trust: bool = False) -> tuple[float, str]:
    code = CodeVerifierConfig(SelfReported.TRUST if trust else SelfReported.REFUSE)
    result = code_reward(
        RewardInput(prompt="", completion=program, reference="", metadata={"tests": tests}),
        sandbox=SANDBOX,
        code_config=code,
    )
    return result.score, result.details


@pytest.fixture(scope="module")
def verifier_process() -> Iterator[ProcessPoolExecutor]:
    """One spawned process that runs the verifier, as the reward service runs verifiers: the sandbox forks its
    child, and a fork of the pytest process (which holds gRPC's threads from earlier tests) can abort in gRPC's
    fork handlers before the child execs."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


@pytest.fixture
def verify(verifier_process: ProcessPoolExecutor) -> Verify:
    def run(program: str, tests: list[str], trust: bool = False) -> tuple[float, str]:
        return verifier_process.submit(_score_here, program, tests, trust).result(timeout=60)

    return run


def _forger(lines: list[dict[str, object]]) -> str:
    """A program that writes ``lines`` to the harness's result descriptor, then ends the interpreter."""
    payload = "".join(json.dumps(line) + "\n" for line in lines)
    return f"import os\nos.write(3, {payload.encode()!r})\nos._exit(0)\n"


def test_forged_pass_lines_on_the_result_channel_score_zero(verify: Verify) -> None:
    program = _forger([{"test": i, "passed": True} for i in range(len(TESTS))])

    score, details = verify(program, TESTS)

    assert score == 0.0, details


def test_forged_guesses_of_every_value_score_zero_once_reported_twice(verify: Verify) -> None:
    program = _forger([{"test": i, "value": repr(v)} for i in range(len(TESTS)) for v in range(20)])

    score, details = verify(program, TESTS)

    assert score == 0.0
    assert "reported twice" in details


def test_the_expected_answers_never_enter_the_sandbox(verify: Verify) -> None:
    program = (
        "import os\nTESTS = open(os.path.join('/src', 'tests.json')).read()\n"
        "def solve(x):\n    return '==' in TESTS or '16' in TESTS\n"
    )  # does it see an answer?

    score, details = verify(program, TESTS)

    assert score == 0.0
    assert "test 0: got False" in details  # it saw the expressions only


def test_an_honest_program_passes_hidden_answer_tests(verify: Verify) -> None:
    score, details = verify("def solve(x):\n    return x * x\n", TESTS)

    assert score == 1.0, details


def test_statement_tests_that_cannot_hide_their_answer_are_counted_as_self_reported_when_trusted(
    verify: Verify,
) -> None:
    score, details = verify(
        "def solve(x):\n    return x * x\n", ["assert solve(2) > 3", "assert solve(2) == 4"], trust=True
    )

    assert score == 1.0
    assert "1 of 2 tests self-reported" in details


def test_process_backend_refuses_to_run_when_the_service_is_not_root() -> None:
    sandbox = Sandbox(SandboxConfig(backend=SandboxBackend.PROCESS))
    sandbox.root = False  # as a service running under its own, unprivileged user

    with pytest.raises(SandboxUnavailable, match="only when the reward service runs as root"):
        sandbox.run_python("p.py", {"p.py": "print(1)"})
