"""The `judge` reward against a real HTTP server that answers as an OpenAI-compatible chat endpoint would, with
scripted replies: grades parsed or refused, failed calls retried, what still fails an ERROR of that completion
alone (never a 0), and the same through the reward service's worker processes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.pb import reward_pb2 as pb
from relayrl.common.pb import reward_pb2_grpc as pb_grpc
from relayrl.reward.api import RewardInput, RewardResult
from relayrl.reward.verifiers.judge import JudgeError, judge, parse_grade
from tests.integration.helpers import reward_server


class Judge:
    """A chat endpoint whose replies a test scripts: ``replies[completion]`` is a list of (HTTP status, content)
    answered in turn (the last one repeats); every request is kept."""

    def __init__(self) -> None:
        self.replies: dict[str, list[tuple[int, str]]] = {}
        self.requests: list[tuple[dict[str, Any], dict[str, str]]] = []
        self.lock = threading.Lock()

    def answer(self, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, str]:
        with self.lock:
            self.requests.append((body, headers))
            text = body["messages"][0]["content"]
            key = next(k for k in self.replies if f"Answer to grade: {k}\n" in text)
            script = self.replies[key]
            return script.pop(0) if len(script) > 1 else script[0]


@pytest.fixture
def chat() -> Iterator[tuple[str, Judge]]:
    state = Judge()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/chat/completions"
            status, content = state.answer(body, dict(self.headers))
            payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", state
    finally:
        server.shutdown()
        server.server_close()


def _inp(completion: str, **metadata: Any) -> RewardInput:
    return RewardInput(prompt="What is 6 x 7?", completion=completion, reference="42", metadata=metadata)


@pytest.mark.parametrize(
    ("reply", "grade"),
    [("SCORE: 7", 0.7), ("Good work.\nSCORE: 10", 1.0), ("SCORE: 3 ... so SCORE: 3", 0.3), ("SCORE: 0", 0.0)],
)
def test_a_single_grade_is_scaled_to_the_unit_interval(reply: str, grade: float) -> None:
    assert parse_grade(reply, r"SCORE:\s*(-?\d+(?:\.\d+)?)", 0, 10) == pytest.approx(grade)


@pytest.mark.parametrize(
    ("reply", "why"),
    [("I think it is fine", "no grade"), ("SCORE: 3 or SCORE: 8", "different grades"), ("SCORE: 11", "outside")],
)
def test_a_reply_without_one_valid_grade_is_refused_not_guessed(reply: str, why: str) -> None:
    with pytest.raises(JudgeError, match=why):
        parse_grade(reply, r"SCORE:\s*(-?\d+(?:\.\d+)?)", 0, 10)


@pytest.mark.parametrize(("reply", "score"), [("Yes, it matches.", 1.0), ("no", 0.0), ("Partly - it is close.", 0.5)])
def test_a_verdict_takes_its_labelled_value(reply: str, score: float) -> None:
    labels = {"yes": 1.0, "no": 0.0, "partly": 0.5}
    assert parse_grade(reply, r"^\W*(yes|no|partly)\b", 0, 1, labels) == score


@pytest.mark.parametrize("reply", ["Maybe.", "Yes and no"])
def test_an_unknown_verdict_or_two_verdicts_are_refused(reply: str) -> None:
    with pytest.raises(JudgeError, match="verdict"):
        parse_grade(reply, r"\b(yes|no|maybe)\b", 0, 1, {"yes": 1.0, "no": 0.0})


def test_a_failed_call_is_retried_and_the_rubric_carries_the_row(
    chat: tuple[str, Judge], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, state = chat
    state.replies = {"42": [(503, ""), (200, "Correct. SCORE: 9")], "41": [(200, "SCORE: 2")]}
    monkeypatch.setenv("JUDGE_KEY", "sk-test-secret")

    results = judge([_inp("42"), _inp("41")], endpoint=url, model="judge-m", api_key_env="JUDGE_KEY", max_tokens=16)

    assert [r.score for r in results if isinstance(r, RewardResult)] == pytest.approx([0.9, 0.2])
    assert len(state.requests) == 3  # the 503 was asked again once
    body, headers = state.requests[-1]
    assert body["model"] == "judge-m" and body["max_tokens"] == 16 and body["temperature"] == 0.0
    assert (
        "What is 6 x 7?" in body["messages"][0]["content"] and "Reference answer: 42" in body["messages"][0]["content"]
    )
    assert headers["Authorization"] == "Bearer sk-test-secret"


def test_a_judgement_that_keeps_failing_is_an_error_of_that_completion_alone(chat: tuple[str, Judge]) -> None:
    url, state = chat
    state.replies = {"42": [(200, "SCORE: 10")], "x": [(200, "no idea")], "y": [(400, "")]}

    ok, unparsable, refused = judge([_inp("42"), _inp("x"), _inp("y")], endpoint=url, attempts=3, temperature=0.7)
    (greedy,) = judge([_inp("x")], endpoint=url, attempts=3)  # temperature 0 would answer the same again

    assert isinstance(ok, RewardResult) and ok.score == 1.0
    assert isinstance(unparsable, JudgeError) and "after 3 attempts" in str(unparsable)
    assert isinstance(greedy, JudgeError) and "after 1 attempts" in str(greedy)
    assert isinstance(refused, JudgeError) and "HTTP 400" in str(refused) and "after 1 attempts" in str(refused)
    assert sum(1 for body, _ in state.requests if "grade: y\n" in body["messages"][0]["content"]) == 1  # no retry


def test_a_rubric_naming_a_field_the_row_lacks_fails_before_any_call(chat: tuple[str, Judge]) -> None:
    url, state = chat
    rubric = "Rubric for {topic}: {completion}\nAnswer to grade: {completion}\n"
    (missing,) = judge([_inp("42")], endpoint=url, rubric=rubric)
    assert isinstance(missing, JudgeError) and "['topic']" in str(missing) and not state.requests
    state.replies = {"42": [(200, "SCORE: 5")]}
    (filled,) = judge([_inp("42", topic="arithmetic")], endpoint=url, rubric=rubric)
    assert (
        isinstance(filled, RewardResult) and "Rubric for arithmetic" in state.requests[0][0]["messages"][0]["content"]
    )


@pytest.mark.integration
async def test_the_reward_service_scores_a_batch_with_the_judge_and_counts_its_failures(
    chat: tuple[str, Judge],
) -> None:
    url, state = chat
    state.replies = {"42": [(200, "SCORE: 10")], "40": [(200, "SCORE: 4")], "?": [(200, "cannot tell")]}
    params = {"endpoint": url, "attempts": 2}
    async with reward_server("judge", params=params) as (target, _), insecure_channel(target) as channel:
        stub = pb_grpc.RewardServiceStub(channel)
        requests = [
            pb.ScoreRequest(episode_id=c, prompt="What is 6 x 7?", completion=c, reference="42")
            for c in ("42", "40", "?")
        ]
        resp = await stub.ScoreBatch(pb.ScoreBatchRequest(requests=requests), timeout=30)
        status = await stub.GetStatus(pb.GetRewardStatusRequest(), timeout=10)

    assert [r.status for r in resp.responses] == [pb.SCORE_STATUS_OK, pb.SCORE_STATUS_OK, pb.SCORE_STATUS_ERROR]
    assert [r.score for r in resp.responses[:2]] == pytest.approx([1.0, 0.4])
    assert resp.responses[0].components["grade"] == 10.0
    assert "no grade" in resp.responses[2].error
    assert (status.scored, status.errors) == (2, 1)


def test_a_judge_on_the_runs_own_inference_names_it_by_placeholder() -> None:
    from dataclasses import replace

    from relayrl.config import RunConfig
    from relayrl.config.reward import ComponentConfig
    from relayrl.reward.main import inference_url
    from relayrl.reward.scorer import with_run_values

    cfg = RunConfig()
    judged = ComponentConfig(name="judge", function="judge", params={"endpoint": "${inference_url}", "attempts": 2})
    reward = replace(cfg.reward, components=[judged], params={"note": "$HOME stays"})
    filled = with_run_values(reward, {"inference_url": inference_url(cfg)})

    host = cfg.inference.server.target.rpartition(":")[0]
    assert filled.components[0].params == {"endpoint": f"http://{host}:{cfg.inference.http.port}/v1", "attempts": 2}
    assert filled.params == {"note": "$HOME stays"}  # only the run's own placeholders are filled


def test_the_judge_example_loads_and_its_judge_asks_the_runs_own_inference() -> None:
    from pathlib import Path

    from relayrl.config import load_run_config
    from relayrl.reward.main import inference_url
    from relayrl.reward.scorer import Scorer, ScorerSpec, with_run_values
    from tests.conftest import REPO

    cfg = load_run_config(REPO / Path("examples/smollm2_judge.yaml"))
    reward = with_run_values(cfg.reward, {"inference_url": inference_url(cfg)})
    scorer = Scorer(ScorerSpec.from_config(reward))  # every function imports, every param is one it takes
    assert scorer.batched and reward.components[1].params["endpoint"] == inference_url(cfg)
