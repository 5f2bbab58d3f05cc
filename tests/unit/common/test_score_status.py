"""One rule decides whether scoring succeeded (relayrl.common.episodes), for rollout, the trainer and evaluation:
a failed score is never a reward of 0 that trains."""

from __future__ import annotations

import pytest

from relayrl.common.episodes import reward_failed, reward_of, score_ok
from relayrl.common.pb import reward_pb2
from relayrl.common.pb.episode_pb2 import Episode

OK, UNSET = reward_pb2.SCORE_STATUS_OK, reward_pb2.SCORE_STATUS_UNSPECIFIED
FAILED = [reward_pb2.SCORE_STATUS_ERROR, reward_pb2.SCORE_STATUS_TIMEOUT]


@pytest.mark.parametrize("status", [OK, UNSET])
def test_ok_and_an_unset_status_carry_the_score(status: int) -> None:
    resp = reward_pb2.ScoreResponse(score=0.75, status=status)

    assert score_ok(status) and reward_of(resp) == 0.75
    assert not reward_failed(Episode(reward=0.75, reward_status=status))


@pytest.mark.parametrize("status", FAILED)
def test_an_error_or_timeout_carries_no_reward_and_marks_the_episode_failed(status: int) -> None:
    resp = reward_pb2.ScoreResponse(score=0.75, status=status, error="verifier raised")

    assert not score_ok(status) and reward_of(resp) == 0.0
    assert reward_failed(Episode(reward=0.0, reward_status=status))


def test_every_status_of_the_proto_is_decided() -> None:
    decided = {OK, UNSET, *FAILED}
    assert decided == set(reward_pb2.ScoreStatus.values())  # a new status must be placed on one side
