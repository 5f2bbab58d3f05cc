"""Built-in verifiers, the reward-function interface, composite rewards and the reward config."""

from __future__ import annotations

import pytest

from relayrl.common.pb import reward_pb2 as pb
from relayrl.config import load_run_config
from relayrl.config.reward import SandboxBackend, SandboxConfig
from relayrl.config.typed import ConfigError
from relayrl.reward.api import (
    RewardFunctionError,
    RewardInput,
    RewardResult,
    bind_params,
    load_reward_function,
    normalize_result,
)
from relayrl.reward.protocol import Status
from relayrl.reward.sandbox import Sandbox
from relayrl.reward.scorer import ComponentSpec, Scorer, ScorerSpec
from relayrl.reward.verifiers.code import code_reward, extract_program
from relayrl.reward.verifiers.match import exact_match, format_reward, normalize_answer, regex_match
from relayrl.reward.verifiers.maths import UnparsableReference, math_reward

SANDBOX = Sandbox(SandboxConfig())  # what a verifier process builds from the default reward.sandbox


def _inp(completion: str, reference: str = "", **metadata: object) -> RewardInput:
    return RewardInput(prompt="q", completion=completion, reference=reference, metadata=metadata)


# a clean set of correct answers: every verifier must give 1.0 (no false zeros)
CORRECT_MATH = [
    ("7", "7"),
    ("\\frac{1}{2}", "The answer is $\\boxed{\\frac{1}{2}}$."),
    ("0.5", "so the result is \\boxed{\\frac{1}{2}}"),
    ("\\frac{1}{2}", "We get $0.5$"),
    ("x^2+2x+1", "$(x+1)^2$"),
    ("\\sqrt{2}", "\\boxed{\\sqrt 2}"),
    ("3\\pi", "Hence $\\boxed{3\\pi}$"),
    ("-4", "Final answer: \\boxed{-4}"),
    ("1000", "\\boxed{1,000}"),
    ("(1, 2)", "The point is $(1,2)$."),
]


@pytest.mark.parametrize(("reference", "completion"), CORRECT_MATH)
def test_math_verifier_scores_equivalent_answers_one(reference: str, completion: str) -> None:
    result = math_reward(_inp(completion, reference))

    assert result.score == 1.0, result.details


@pytest.mark.parametrize(
    ("reference", "completion"), [("7", "\\boxed{8}"), ("\\frac{1}{2}", "$\\frac{1}{3}$"), ("x^2", "$x^3$")]
)
def test_math_verifier_scores_wrong_answers_zero(reference: str, completion: str) -> None:
    assert math_reward(_inp(completion, reference)).score == 0.0


def test_math_verifier_without_an_answer_is_zero_with_the_reason() -> None:
    result = math_reward(_inp("I do not know", "7"))

    assert (result.score, result.details) == (0.0, "no answer found")


def test_math_verifier_with_an_unparsable_reference_raises() -> None:
    with pytest.raises(UnparsableReference):
        math_reward(_inp("\\boxed{1}", ""))


@pytest.mark.parametrize(
    ("completion", "reference", "normalize", "expected"),
    [
        ("  Paris. ", "paris", True, 1.0),
        ('"PARIS"', "paris", True, 1.0),
        ("Paris", "paris", False, 0.0),
        ("Paris", "Paris", False, 1.0),
        ("Lyon", "paris", True, 0.0),
    ],
)
def test_exact_match_compares_raw_or_normalised_text(
    completion: str, reference: str, normalize: bool, expected: float
) -> None:
    assert exact_match(_inp(completion, reference), normalize=normalize).score == expected


def test_exact_match_in_a_tag_uses_the_last_tag_and_scores_a_missing_tag_zero() -> None:
    text = "<answer>41</answer> no wait <answer> 42 </answer>"

    assert exact_match(_inp(text, "42"), tag="answer").score == 1.0
    assert exact_match(_inp("42", "42"), tag="answer").score == 0.0


def test_normalize_answer_folds_case_space_quotes_and_trailing_period() -> None:
    assert normalize_answer("  The   ANSWER is `x`. ") == "the answer is `x`"
    assert normalize_answer("$42$.") == "42"


def test_regex_matches_the_completion_or_compares_its_group_with_the_reference() -> None:
    assert regex_match(_inp("result: 42"), pattern=r"\d+").score == 1.0
    assert regex_match(_inp("no digits"), pattern=r"\d+").score == 0.0
    assert regex_match(_inp("Answer: 42", "42"), pattern=r"Answer:\s*(\d+)", compare_reference=True).score == 1.0
    assert regex_match(_inp("Answer: 41", "42"), pattern=r"Answer:\s*(\d+)", compare_reference=True).score == 0.0
    assert regex_match(_inp("abc", pattern="a.c")).score == 1.0  # pattern from the row's metadata


def test_regex_without_a_pattern_raises() -> None:
    with pytest.raises(ValueError, match="needs a pattern"):
        regex_match(_inp("x"))


def test_format_reward_requires_a_non_empty_tag_and_optionally_thinking_first() -> None:
    assert format_reward(_inp("<answer>4</answer>")).score == 1.0
    assert format_reward(_inp("<answer> </answer>")).score == 0.0
    assert format_reward(_inp("4")).score == 0.0
    assert format_reward(_inp("<think>2+2</think><answer>4</answer>"), require_think=True).score == 1.0
    assert format_reward(_inp("<answer>4</answer><think>2+2</think>"), require_think=True).score == 0.0


def test_program_is_the_last_fenced_block_or_the_whole_completion() -> None:
    assert extract_program("text\n```python\na = 1\n```\nmore\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_program("def f(): return 1") == "def f(): return 1"


def test_code_reward_is_the_fraction_of_assert_tests_passed() -> None:
    program = "```python\ndef add(a, b):\n    return a + b if a < 100 else 0\n```"
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(100, 1) == 101", "assert add(0, 0) == 0"]

    result = code_reward(_inp(program, tests=tests), sandbox=SANDBOX)

    assert result.score == 0.75
    assert result.details == "3/4 tests passed; test 2: got 0, expected 101"


def test_code_reward_runs_io_tests_with_stdin_and_compares_stdout() -> None:
    program = "import sys\nnums = [int(x) for x in sys.stdin.read().split()]\nprint(sum(nums))\n"
    cases = [{"input": "1 2 3", "output": "6"}, {"input": "10", "output": "10\n"}, {"input": "1 1", "output": "3"}]

    result = code_reward(_inp(program, io_tests=cases), sandbox=SANDBOX)

    assert result.score == pytest.approx(2 / 3)
    assert "case 2" in result.details


def test_code_reward_for_a_program_that_does_not_compile_is_zero_with_the_error() -> None:
    result = code_reward(_inp("def f(:\n", tests=["assert f() == 1"]), sandbox=SANDBOX)

    assert result.score == 0.0
    assert "SyntaxError" in result.details


def test_code_reward_without_tests_raises() -> None:
    with pytest.raises(ValueError, match="needs `tests`"):
        code_reward(_inp("print(1)"), sandbox=SANDBOX)


def test_registered_reward_names_load_and_unknown_names_are_config_errors() -> None:
    assert load_reward_function("math") is math_reward
    with pytest.raises(ConfigError, match=r"registered reward .*math"):
        load_reward_function("no_such_reward")


def test_params_are_bound_after_the_input_and_unknown_params_are_config_errors() -> None:
    fn = bind_params(exact_match, {"normalize": False}, "reward.params")

    assert fn(_inp("Paris", "paris")).score == 0.0  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"reward\.params"):
        bind_params(exact_match, {"normalise": True}, "reward.params")


@pytest.mark.parametrize("value", [float("inf"), "1", None, True, RewardResult(1.0, {"c": float("nan")})])
def test_normalize_result_rejects_non_scores(value: object) -> None:
    with pytest.raises(RewardFunctionError):
        normalize_result(value)


def test_composite_total_is_the_weighted_sum_and_a_failing_component_fails_it() -> None:
    scorer = Scorer(
        ScorerSpec(
            components=(
                ComponentSpec("fmt", "format", 0.2),
                ComponentSpec("answer", "exact_match", 0.8, {"tag": "answer"}),
            )
        )
    )

    result = scorer(_inp("<answer>42</answer>", "42"))
    wrong = scorer(_inp("<answer>41</answer>", "42"))

    assert result.score == pytest.approx(1.0)
    assert result.components == {"fmt": 1.0, "fmt.format": 1.0, "answer": 1.0, "answer.match": 1.0}
    assert wrong.score == pytest.approx(0.2)
    with pytest.raises(RewardFunctionError, match="component 'answer' failed: ValueError"):
        scorer(_inp("<answer>41</answer>", ""))


def test_reward_config_timeout_must_exceed_the_code_budget_and_names_must_be_unique() -> None:
    with pytest.raises(ConfigError, match=r"reward\.timeout_s"):
        load_run_config(None, ["reward.timeout_s=5", "reward.sandbox.total_timeout_s=8"])
    with pytest.raises(ConfigError, match=r"reward\.components"):
        load_run_config(None, ["reward.components=[{name: a, function: math}, {name: a, function: format}]"])
    cfg = load_run_config(
        None,
        [
            "reward.components=[{name: a, function: math, weight: 0.5, params: {strict: false}}]",
            "reward.sandbox.backend=process",
        ],
    )
    assert cfg.reward.components[0].params == {"strict": False}


def test_the_scorer_gives_its_sandbox_to_verifiers_that_take_one_and_only_to_them() -> None:
    sandbox = Sandbox(SandboxConfig(backend=SandboxBackend.PROCESS))
    scorer = Scorer(
        ScorerSpec(
            components=(
                ComponentSpec("sandboxed", "tests.reward_fns:sandbox_backend"),
                ComponentSpec("plugin", "tests.reward_fns:keywords", params={"scale": 2.0}),
            )
        ),
        sandbox=sandbox,
    )

    result = scorer(_inp("x"))

    assert result.details == "sandboxed: process; plugin: scale"  # fn(inp, **params) gets its params alone
    assert result.components["plugin"] == 1.0


def test_sandbox_is_not_a_parameter_and_a_sandboxed_verifier_needs_a_scorer_with_one() -> None:
    with pytest.raises(ConfigError, match=r"reward\.params.*sandbox"):
        Scorer(ScorerSpec(function="code", params={"sandbox": "none"}), sandbox=SANDBOX)
    with pytest.raises(ValueError, match="sandbox"):
        Scorer(ScorerSpec(function="code"))


def test_one_status_maps_to_the_grpc_status_and_the_rest_string() -> None:
    assert {s: (s.pb, s.value) for s in Status} == {
        Status.OK: (pb.SCORE_STATUS_OK, "ok"),
        Status.ERROR: (pb.SCORE_STATUS_ERROR, "error"),
        Status.TIMEOUT: (pb.SCORE_STATUS_TIMEOUT, "timeout"),
    }
