"""Scoring with a reward that runs code (the ``code`` verifier, or a plugin declared with ``runs_code``) needs the
code token, as RunCode does: gRPC Score/ScoreBatch and REST ``POST /score`` without it are refused before any
verifier (or sandbox) runs; pure rewards stay open. Rollout's reward client sends the token it holds."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import pytest

from relayrl.client import RewardClient
from relayrl.common.pb import reward_pb2 as pb
from relayrl.config.reward import SandboxConfig
from relayrl.reward.sandbox import Sandbox
from relayrl.reward.scorer import ComponentSpec, Scorer, ScorerSpec
from relayrl.reward.server import RewardServicer
from relayrl.rollout.clients import RolloutClients
from tests.integration.helpers import reward_http, reward_server

pytestmark = pytest.mark.security

TOKEN = "k" * 32
RUNS_CODE = "tests.reward_fns:runs_a_program"
SANDBOX = SandboxConfig(wall_timeout_s=2.0, total_timeout_s=2.0)
PROGRAM = "```python\ndef f(x):\n    return x * x\n```"
CODE_METADATA = {"tests": json.dumps(["assert f(3) == 9"])}
REFUSED = [
    ("", TOKEN, grpc.StatusCode.PERMISSION_DENIED),
    (TOKEN, "", grpc.StatusCode.UNAUTHENTICATED),
    (TOKEN, "wrong" * 8, grpc.StatusCode.UNAUTHENTICATED),
]
REFUSED_IDS = ["service-without-token", "no-token", "wrong-token"]


def _marked(marker: Path) -> pb.ScoreRequest:
    return pb.ScoreRequest(episode_id="e", completion="x", metadata={"marker": json.dumps(str(marker))})


def _nothing_scored(servicer: RewardServicer) -> bool:
    return servicer.scored + servicer.errors + servicer.timeouts == 0


@pytest.mark.parametrize("rpc", ["Score", "ScoreBatch"])
@pytest.mark.parametrize(("server_token", "client_token", "code"), REFUSED, ids=REFUSED_IDS)
async def test_scoring_with_a_code_running_plugin_without_the_code_token_is_refused_before_it_runs(
    tmp_path: Path, rpc: str, server_token: str, client_token: str, code: grpc.StatusCode
) -> None:
    marker = tmp_path / "ran"

    async def go() -> None:
        async with (
            reward_server(RUNS_CODE, code_token=server_token, workers=1) as (target, servicer),
            RewardClient(target, token=client_token, retries=0) as client,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                if rpc == "Score":
                    await client.score(_marked(marker), timeout_s=10)
                else:
                    await client.score_batch([_marked(marker)] * 3, timeout_s=10)

            assert info.value.code() == code
            assert TOKEN not in (info.value.details() or "")
            assert _nothing_scored(servicer)
        assert not marker.exists()  # the verifier never ran

    await go()


async def test_the_code_verifier_scores_only_for_the_code_token_and_its_sandbox_runs_only_then() -> None:
    request = pb.ScoreRequest(episode_id="e", completion=PROGRAM, metadata=CODE_METADATA)

    async def go() -> None:
        async with (
            reward_server("code", code_token=TOKEN, workers=1, sandbox=SANDBOX) as (target, servicer),
            RewardClient(target, retries=0) as anonymous,
            RewardClient(target, token=TOKEN, retries=0) as holder,
        ):
            for call in (anonymous.score(request, timeout_s=10), anonymous.score_batch([request], timeout_s=10)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _nothing_scored(servicer)  # no verifier call, so no sandbox run

            one = await holder.score(request, timeout_s=30)
            batch = await holder.score_batch([request, request], timeout_s=30)

            assert (one.status, one.score) == (pb.SCORE_STATUS_OK, 1.0), one.error
            assert [(r.status, r.score) for r in batch.responses] == [(pb.SCORE_STATUS_OK, 1.0)] * 2
            assert servicer.scored == 3

    await go()


async def test_rollouts_reward_client_sends_the_code_token_it_holds_on_score_batch(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    async def go() -> None:
        async with reward_server(RUNS_CODE, code_token=TOKEN, workers=1) as (target, _):
            clients = RolloutClients.connect("127.0.0.1:1", target, "127.0.0.1:1", code_token=TOKEN)
            try:
                got = await clients.reward.score_batch([_marked(marker)], timeout_s=10)
            finally:
                await clients.close()

            assert [r.status for r in got.responses] == [pb.SCORE_STATUS_OK]
        assert marker.exists()

    await go()


@pytest.mark.parametrize(
    ("server_token", "header", "status"),
    [
        ("", f"Bearer {TOKEN}", 403),
        (TOKEN, None, 401),
        (TOKEN, "Bearer " + "wrong" * 8, 401),
        (TOKEN, TOKEN, 401),
    ],
    ids=["service-without-token", "no-header", "wrong-token", "not-bearer"],
)
async def test_rest_score_with_a_code_running_reward_needs_the_code_token_before_it_runs(
    tmp_path: Path, server_token: str, header: str | None, status: int
) -> None:
    marker = tmp_path / "ran"
    body = {"completion": "x", "metadata": {"marker": str(marker)}}

    async def go() -> None:
        async with (
            reward_server(RUNS_CODE, code_token=server_token, workers=1) as (_, servicer),
            reward_http(servicer) as url,
            httpx.AsyncClient(base_url=url, timeout=10) as client,
        ):
            refused = await client.post("/score", json=body, headers={"Authorization": header} if header else {})

            assert refused.status_code == status
            assert TOKEN not in refused.text
            assert _nothing_scored(servicer)
            assert not marker.exists()
            if server_token:
                ok = await client.post("/score", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
                assert ok.status_code == 200 and ok.json()["status"] == "ok"
                assert marker.exists()

    await go()


async def test_a_pure_reward_needs_no_token_over_grpc_or_rest() -> None:
    async def go() -> None:
        async with (
            reward_server("arithmetic", code_token=TOKEN, workers=1) as (target, servicer),
            reward_http(servicer) as url,
            RewardClient(target, retries=0) as client,
            httpx.AsyncClient(base_url=url, timeout=10) as http,
        ):
            one = await client.score(pb.ScoreRequest(completion="7", reference="7"), timeout_s=10)
            batch = await client.score_batch([pb.ScoreRequest(completion="6", reference="7")], timeout_s=10)
            rest = await http.post("/score", json={"completion": "7", "reference": "7"})

            assert (one.status, one.score) == (pb.SCORE_STATUS_OK, 1.0)
            assert [(r.status, r.score) for r in batch.responses] == [(pb.SCORE_STATUS_OK, 0.0)]
            assert rest.status_code == 200 and rest.json()["score"] == 1.0

    await go()


@pytest.mark.parametrize(
    ("spec", "runs"),
    [
        (ScorerSpec(function="code"), True),
        (ScorerSpec(function=RUNS_CODE), True),
        (ScorerSpec(function="tests.reward_fns:sandbox_backend"), True),  # takes the sandbox: runs code
        (ScorerSpec(function="math"), False),
        (ScorerSpec(function="exact_match", params={"normalize": False}), False),
        (ScorerSpec(components=(ComponentSpec("fmt", "format"), ComponentSpec("tests", "code"))), True),
        (ScorerSpec(components=(ComponentSpec("fmt", "format"), ComponentSpec("answer", "exact_match"))), False),
    ],
    ids=[
        "code",
        "declared-plugin",
        "sandbox-plugin",
        "math",
        "exact_match-with-params",
        "composite-with-code",
        "composite-pure",
    ],
)
def test_a_reward_runs_code_when_a_function_takes_the_sandbox_or_declares_it(spec: ScorerSpec, runs: bool) -> None:
    assert Scorer(spec, sandbox=Sandbox(SANDBOX)).runs_code is runs
