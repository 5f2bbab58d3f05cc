"""The lookup example (relayrl.tasks.lookup): an argument-free calculator bound to the episode's question by the
tools workflow; its reward credits each step of the tool use, 1.0 only for the whole; its dataset's fixed layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.common.dataset import Prompt
from relayrl.config.rollout import ToolFormat
from relayrl.reward.api import RewardInput
from relayrl.rollout.workflows.tools import ToolEnvironment, ToolSet, tool_schema
from relayrl.tasks.lookup import c, make_dataset, reward


def _score(transcript: str, final: str, prompt: str = "7*8=", answer: str = "56") -> tuple[float, dict[str, float]]:
    res = reward(RewardInput(prompt, final, answer, {"transcript": transcript}))
    return res.score, dict(res.components)


def test_ideal_episode_scores_one() -> None:
    score, parts = _score("<c></c><r>56</r>56", "56")

    assert score == pytest.approx(1.0, abs=1e-12)  # a sum of weights that add up to 1
    assert parts == {"call": 1.0, "ran": 1.0, "copy": 1.0, "answer": 1.0, "exact": 1.0}


def test_right_call_with_uncopied_result_gets_only_the_call() -> None:
    score, parts = _score("<c></c><r>56</r>21", "21")

    assert parts == {"call": 1.0, "ran": 1.0, "copy": 0.0, "answer": 0.0, "exact": 0.0}
    assert score == pytest.approx(0.3, abs=1e-12)  # call 0.2 + ran 0.1


def test_call_credit_stops_at_the_first_wrong_character() -> None:
    _, shifted = _score("<c><<c>>", "")
    _, prefix = _score("<c></5<>", "")

    assert shifted["call"] == pytest.approx(4 / 8)  # "<c><" then "<" where "/" belongs: "c>" after it earn nothing
    assert prefix["call"] == pytest.approx(5 / 8)  # of the longer of the two (8 characters)
    assert shifted["ran"] == prefix["ran"] == 0.0


def test_a_whole_call_that_got_no_result_earns_no_call_credit() -> None:
    # the text of "<c><unk></c>": 8 tokens, so the tool's output did not fit the episode's 16; RL found it in CI
    score, parts = _score("<c></c>", "")

    assert parts["call"] == parts["ran"] == 0.0 and score == 0.0


def test_right_answer_without_a_call_stays_under_the_target() -> None:
    score, parts = _score("56", "56")

    assert parts["copy"] == parts["ran"] == parts["call"] == 0.0 and parts["answer"] == 1.0
    assert score < 0.8  # the 0.8 target cannot be reached without the tool


def test_call_with_an_argument_did_not_run_and_its_error_is_no_answer_to_copy() -> None:
    _, parts = _score("<c>7*8</c><r>error: ValueError: c takes no argument</r>56", "56")

    assert parts["ran"] == parts["copy"] == 0.0 and parts["answer"] == 1.0


def test_tool_answers_the_bound_question_and_rejects_an_argument() -> None:
    assert c("", question="7*8=") == "56"
    with pytest.raises(ValueError, match="no argument"):
        c("9*9", question="7*8=")


async def test_tools_workflow_binds_the_episode_prompt_and_hides_it_from_the_schema() -> None:
    tools = ToolSet.from_specs(["relayrl.tasks.lookup:c"], ToolFormat.TAGGED, timeout_s=5.0)
    env = ToolEnvironment(tools, max_tool_calls=2)

    async def episode() -> tuple[str, str]:
        await env.reset(Prompt("p0", "6*9=", "54"), seed=0)
        step = await env.step("<c></c>")
        forged = await tools.call("c", {"question": "2*5="}, question="6*9=")
        return step.observation, forged[0]

    observation, forged = await episode()
    assert observation == "<r>54</r>"
    assert forged.startswith("error: c takes no argument question")  # the model cannot set the bound question
    assert "question" not in tool_schema(c, "c")["parameters"]["properties"]


def test_dataset_holds_distinct_tens_digits_of_two_digit_products_in_one_layout(tmp_path: Path) -> None:
    n = make_dataset(tmp_path / "lookup.jsonl", rows=500)

    rows = [json.loads(line) for line in (tmp_path / "lookup.jsonl").read_text().splitlines()]
    assert n == len(rows) == len({r["prompt"] for r in rows}) == 500
    assert all(len(r["prompt"]) == 13 and len(r["answer"]) == 1 for r in rows)  # the copy is one token, one offset
    assert all(c("", question=r["prompt"]) == r["answer"] for r in rows)  # the tool answers each question
    assert len({r["answer"] for r in rows}) == 10


def test_dataset_keeps_every_question_when_asked_for_more_rows_than_exist(tmp_path: Path) -> None:
    n = make_dataset(tmp_path / "lookup.jsonl", rows=10_000)

    assert n == 90 * 90
