"""The calculator example's reward (relayrl.tasks.calculator): credit for each step of the tool-use behaviour, 1.0
only for the whole of it; and its dataset's fixed layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.reward.api import RewardInput
from relayrl.tasks.calculator import make_dataset, reward


def _score(transcript: str, final: str, prompt: str = "7*8=", answer: str = "56") -> tuple[float, dict[str, float]]:
    res = reward(RewardInput(prompt, final, answer, {"transcript": transcript}))
    return res.score, dict(res.components)


def test_ideal_episode_scores_one() -> None:
    score, parts = _score("<c>7*8</c><r>56</r>56", "56")

    assert score == pytest.approx(1.0, abs=1e-12)  # a sum of weights that add up to 1
    assert parts == {"call": 1.0, "ran": 1.0, "copy": 1.0, "answer": 1.0, "exact": 1.0}


def test_wrong_operand_copied_faithfully_gets_call_and_copy_credit_but_under_half() -> None:
    score, parts = _score("<c>7*9</c><r>63</r>63", "63")

    assert parts["call"] == pytest.approx(0.9) and parts["ran"] == parts["copy"] == 1.0 and parts["answer"] == 0.0
    assert score < 0.5 and parts["exact"] == 0.0


def test_right_call_with_uncopied_result_gets_only_the_call() -> None:
    score, parts = _score("<c>7*8</c><r>56</r>21", "21")

    assert parts == {"call": 1.0, "ran": 1.0, "copy": 0.0, "answer": 0.0, "exact": 0.0}
    assert 0.0 < score < 0.5


def test_answer_without_a_call_gets_no_copy_credit() -> None:
    score, parts = _score("56", "56")

    assert parts["copy"] == parts["ran"] == parts["call"] == 0.0 and parts["answer"] == 1.0
    assert score < 0.8  # the 0.8 target cannot be reached without the tool


def test_call_the_tool_rejects_did_not_run_and_its_error_is_no_answer_to_copy() -> None:
    _, parts = _score("<c>7*</c><r>error: SyntaxError</r>56", "56")

    assert parts["ran"] == parts["copy"] == 0.0 and parts["answer"] == 1.0


def test_dataset_holds_distinct_products_with_two_digit_results(tmp_path: Path) -> None:
    n = make_dataset(tmp_path / "calc.jsonl")

    rows = [json.loads(line) for line in (tmp_path / "calc.jsonl").read_text().splitlines()]
    assert n == len(rows) == len({r["prompt"] for r in rows}) == 58
    assert all(len(r["prompt"]) == 4 and len(r["answer"]) == 2 for r in rows)
    assert all(int(r["prompt"][0]) * int(r["prompt"][2]) == int(r["answer"]) for r in rows)
