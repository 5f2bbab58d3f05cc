"""The trainer's data wait split at the moment the batch's last group left rollout (its episodes' enqueued_at)."""

from __future__ import annotations

import pytest

from relayrl.common.pb.episode_pb2 import Episode, EpisodeGroup
from relayrl.common.stream import StreamEntry
from relayrl.trainer.loop import generation_wait


def _entry(*enqueued_at: float) -> StreamEntry:
    return StreamEntry("1-0", EpisodeGroup(group_id="g", episodes=[Episode(enqueued_at=t) for t in enqueued_at]))


def test_a_batch_ready_before_the_wait_began_was_all_in_transit() -> None:
    assert generation_wait([_entry(99.0, 99.5), _entry(98.0)], start=100.0, end=100.2) == 0.0


def test_the_wait_before_the_last_group_left_rollout_was_for_generation() -> None:
    got = generation_wait([_entry(100.1), _entry(100.3, 100.25)], start=100.0, end=100.4)

    assert got == pytest.approx(0.3, rel=0, abs=1e-9)  # float differences of a few seconds-since-epoch values


def test_generation_never_exceeds_the_wait_and_unknown_times_leave_the_split_unmeasured() -> None:
    assert generation_wait([_entry(101.0)], start=100.0, end=100.4) == pytest.approx(0.4, rel=0, abs=1e-9)
    assert generation_wait([_entry(100.3, 0.0)], start=100.0, end=100.4) is None  # a producer that did not say
    assert generation_wait([], start=100.0, end=100.4) is None
