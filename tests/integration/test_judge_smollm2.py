"""The packaged SmolLM2-135M-Instruct as a judge: served by relayrl's own inference (its OpenAI-compatible API), it
grades completions through the reward service's `judge`. Its verdicts parse into scores; a rubric whose grade it
does not write gives ERROR results, counted, never a 0."""

from __future__ import annotations

from typing import Any

import pytest

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.pb import reward_pb2 as pb
from relayrl.common.pb import reward_pb2_grpc as pb_grpc
from tests.integration.helpers import inference_server, reward_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUBRIC = (
    "Question: {prompt}\nCorrect answer: {reference}\nStudent answer: {completion}\n"
    "Does the student answer match the correct answer? Reply with yes or no."
)
COMPLETIONS = ("42", "The answer is 42.", "I like turtles")


async def _score(target: str) -> tuple[list[Any], Any]:
    async with insecure_channel(target) as channel:
        stub = pb_grpc.RewardServiceStub(channel)
        requests = [
            pb.ScoreRequest(episode_id=str(i), prompt="What is 6 x 7?", completion=c, reference="42")
            for i, c in enumerate(COMPLETIONS)
        ]
        resp = await stub.ScoreBatch(pb.ScoreBatchRequest(requests=requests), timeout=120)
        return list(resp.responses), await stub.GetStatus(pb.GetRewardStatusRequest(), timeout=10)


async def test_smollm2_served_by_relayrl_judges_completions_through_the_reward_service(smollm2_import: Any) -> None:
    async with inference_server(smollm2_import.out, http=True) as (_, service):
        endpoint = f"http://127.0.0.1:{service.http_port}/v1"  # type: ignore[attr-defined]
        verdicts = {"endpoint": endpoint, "rubric": RUBRIC, "score_pattern": r"^\W*(yes|no)\b", "max_tokens": 8}
        async with reward_server("judge", params={**verdicts, "labels": {"yes": 1.0, "no": 0.0}}) as (target, _):
            judged, status = await _score(target)
        async with reward_server("judge", params={"endpoint": endpoint, "max_tokens": 8}) as (target, _):
            ungraded, ungraded_status = await _score(target)
        served = service.requests_served

    assert [r.status for r in judged] == [pb.SCORE_STATUS_OK] * 3, [r.error for r in judged]
    assert all(r.score in (0.0, 1.0) and r.details for r in judged)  # the verdict's value; the reply as details
    assert (status.scored, status.errors) == (3, 0)
    # the default rubric asks for "SCORE: N", which this small model does not write: refused, not guessed
    assert [r.status for r in ungraded] == [pb.SCORE_STATUS_ERROR] * 3
    assert all("no grade in the judge's reply" in r.error for r in ungraded)
    assert (ungraded_status.scored, ungraded_status.errors) == (0, 3)
    assert served >= 6  # every judgement was a generation of the served model
