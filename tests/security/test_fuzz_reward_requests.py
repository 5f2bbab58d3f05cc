"""Property tests of the reward service's request handling over real gRPC and HTTP: whatever a caller sends,
the answer is a score, an explicit error result or a clean 4xx / gRPC status, never a 500 or a dead server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayrl.common.pb import reward_pb2 as pb
from relayrl.common.pb import reward_pb2_grpc as pb_grpc
from tests.integration.helpers import reward_http, reward_server

pytestmark = pytest.mark.security

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
STATUSES = {"ok", "error", "timeout"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=8,
)
fields = {
    "episode_id": json_values,
    "prompt": json_values,
    "completion": json_values,
    "reference": json_values,
    "metadata": json_values | st.dictionaries(st.text(max_size=10), json_values, max_size=3),
}
bodies = st.fixed_dictionaries({}, optional=fields) | json_values


@pytest.fixture(scope="module")
def reward_endpoints() -> Iterator[tuple[str, str]]:
    """A real reward service (gRPC target, REST base URL), served from its own event loop thread."""
    ready: dict[str, str] = {}
    started, done = threading.Event(), None
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        nonlocal done
        done = asyncio.Event()
        async with reward_server(workers=1) as (target, servicer), reward_http(servicer) as url:
            ready.update(target=target, url=url)
            started.set()
            await done.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(60), "the reward service did not start"
    yield ready["target"], ready["url"]
    assert done is not None
    loop.call_soon_threadsafe(done.set)
    thread.join(30)


def _check_rest(response: httpx.Response) -> None:
    assert response.status_code in (200, 400, 413, 422), response.text
    data = response.json()
    if response.status_code == 200:
        assert data["status"] in STATUSES
        assert (data["score"] is None) == (data["status"] != "ok")


@SETTINGS
@given(body=bodies)
def test_any_json_body_gets_a_result_or_a_clean_4xx(reward_endpoints: tuple[str, str], body: Any) -> None:
    _, url = reward_endpoints

    response = httpx.post(
        f"{url}/score", content=json.dumps(body), timeout=30, headers={"content-type": "application/json"}
    )

    _check_rest(response)


@SETTINGS
@given(raw=st.binary(max_size=200))
def test_any_bytes_as_body_get_a_clean_4xx(reward_endpoints: tuple[str, str], raw: bytes) -> None:
    _, url = reward_endpoints

    response = httpx.post(f"{url}/score", content=raw, timeout=30, headers={"content-type": "application/json"})

    _check_rest(response)


requests = st.builds(
    pb.ScoreRequest,
    episode_id=st.text(max_size=10),
    prompt=st.text(max_size=30),
    completion=st.text(max_size=30),
    reference=st.text(max_size=10),
    metadata=st.dictionaries(st.text(max_size=8), st.text(max_size=20) | json_values.map(json.dumps), max_size=3),
)


@SETTINGS
@given(batch=st.lists(requests, max_size=5))
def test_any_score_batch_gets_one_result_per_request(
    reward_endpoints: tuple[str, str], batch: list[pb.ScoreRequest]
) -> None:
    target, _ = reward_endpoints
    with grpc.insecure_channel(target) as channel:
        response = pb_grpc.RewardServiceStub(channel).ScoreBatch(pb.ScoreBatchRequest(requests=batch), timeout=30)

    assert [r.episode_id for r in response.responses] == [r.episode_id for r in batch]
    assert all(
        r.status in (pb.SCORE_STATUS_OK, pb.SCORE_STATUS_ERROR, pb.SCORE_STATUS_TIMEOUT) for r in response.responses
    )


@SETTINGS
@given(raw=st.binary(max_size=200))
def test_undecodable_grpc_request_bytes_are_refused_and_the_server_keeps_serving(
    reward_endpoints: tuple[str, str], raw: bytes
) -> None:
    target, _ = reward_endpoints
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary("/relayrl.v1.RewardService/ScoreBatch")
        try:
            call(raw, timeout=30)
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
        status = pb_grpc.RewardServiceStub(channel).GetStatus(pb.GetRewardStatusRequest(), timeout=10)

    assert status.workers_ready == 1
