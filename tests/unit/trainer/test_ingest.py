"""The trainer's ingest stage (relayrl.trainer.ingest): a group's facts read once, its verdict by precedence, and
the step's columnar batch; and the training positions the learner slices its micro-batches from
(relayrl.trainer.batching.Positions)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from relayrl.common.pb import reward_pb2
from relayrl.common.pb.episode_pb2 import Episode, EpisodeGroup
from relayrl.common.stream import StreamEntry
from relayrl.trainer.batching import Positions
from relayrl.trainer.ingest import Ingested, StepBatch, Verdict, judge


def _episode(gid: str, index: int, reward: float, versions: list[int], failed: bool = False) -> Episode:
    n = len(versions)
    return Episode(
        episode_id=f"{gid}-{index}",
        group_id=gid,
        sample_index=index,
        group_size=2,
        prompt_token_ids=[1, 2],
        completion_token_ids=[3] * n,
        behaviour_logprobs=[-0.5] * n,
        token_weight_versions=versions,
        loss_mask=[1] * n,
        reward=reward,
        reward_status=reward_pb2.SCORE_STATUS_ERROR if failed else reward_pb2.SCORE_STATUS_OK,
    )


def _ingested(gid: str, *episodes: Episode) -> Ingested:
    return Ingested.of(StreamEntry(f"0-{gid}", EpisodeGroup(group_id=gid, episodes=list(episodes))))


def test_a_groups_facts_come_from_its_token_lists_once() -> None:
    ing = _ingested("g", _episode("g", 0, 1.0, [3, 5]), _episode("g", 1, 1.0, [4, 4, 4], failed=True))

    assert (ing.oldest_each, ing.newest_each, ing.mixed_each) == ((3, 4), (5, 4), (True, False))
    assert (ing.oldest, ing.newest, ing.failed, ing.size) == (3, 5, (1,), 2)
    assert ing.same_rewards  # one valid episode: nothing to compare
    assert ing.lists[0].completion == [3, 3] and ing.lists[1].versions == [4, 4, 4]


@pytest.mark.parametrize(
    ("episodes", "lag", "ahead", "drop_zero", "verdict"),
    [
        # every score failed: a reward error, whatever its staleness
        ([(1.0, True), (0.0, True)], 9, 9, True, Verdict.REWARD_ERROR),
        # a version the lineage places after the trainer's weights: invalid, before staleness
        ([(1.0, False), (0.0, False)], 0, -1, True, Verdict.INVALID),
        ([(1.0, False), (0.0, False)], 2, 0, True, Verdict.STALE),  # max_staleness 1
        ([(1.0, False), (1.0, False)], 1, 0, True, Verdict.ZERO_ADVANTAGE),
        ([(1.0, False), (1.0, False)], 1, 0, False, Verdict.OK),  # dynamic sampling's budget spent (or off)
        ([(1.0, False), (0.0, True)], 1, 0, True, Verdict.ZERO_ADVANTAGE),  # one valid episode: no advantage
        ([(1.0, False), (0.0, False)], 1, 0, True, Verdict.OK),
    ],
)
def test_the_verdict_follows_the_rules_in_order(
    episodes: list[tuple[float, bool]], lag: int, ahead: int, drop_zero: bool, verdict: Verdict
) -> None:
    ing = _ingested("g", *(_episode("g", i, r, [1], failed=f) for i, (r, f) in enumerate(episodes)))

    got, why = judge(ing, lag, ahead, max_staleness=1, drop_zero_advantage=drop_zero)

    assert got is verdict
    assert (why == "") == (verdict is Verdict.OK)


def test_a_step_batch_leaves_failed_episodes_out_counts_them_and_keeps_each_column_in_episode_order() -> None:
    a = _ingested("a", _episode("a", 0, 1.0, [2, 3]), _episode("a", 1, 0.0, [3], failed=True))
    b = _ingested("b", _episode("b", 0, 0.5, [1]), _episode("b", 1, 0.25, [3, 3, 3]))

    batch = StepBatch.take([a, b], lags={2: 1, 1: 2, 3: 0})

    assert len(batch) == 3 and batch.excluded == 1 and batch.num_groups == 2
    assert [e.episode_id for e in batch.episodes] == ["a-0", "b-0", "b-1"]
    assert batch.group_index.tolist() == [0, 1, 1]
    assert batch.reward.tolist() == [1.0, 0.5, 0.25]  # exact binary fractions
    assert batch.staleness.tolist() == [1.0, 2.0, 0.0]  # each episode's oldest version, through the lineage
    assert (batch.oldest.tolist(), batch.newest.tolist()) == ([2, 1, 3], [3, 1, 3])
    assert batch.completion_len.tolist() == [2.0, 1.0, 3.0] and batch.loss_tokens == 6.0
    assert batch.positions.sizes == (3, 2, 4)  # prompt 2 + completion - 1 positions each
    assert [e.entry_id for e in batch.entries] == ["0-a", "0-b"]


def test_groups_laid_out_as_they_arrive_join_into_the_batch_built_at_once() -> None:
    """The collector builds each valid group's columns as it arrives (Ingested.valid); taking the step only joins
    them. Compared exactly: both ways copy the same values, nothing is computed differently."""
    a = _ingested("a", _episode("a", 0, 1.0, [2, 3]), _episode("a", 1, 0.0, [3], failed=True))
    b = _ingested("b", _episode("b", 0, 0.5, [1]), _episode("b", 1, 0.25, [3, 3, 3]))
    c = _ingested("c", _episode("c", 0, 0.0, [3, 3]))
    lags = {2: 1, 1: 2, 3: 0}

    at_once = StepBatch.take([a, b, c], lags)
    joined = StepBatch.take([a.valid(), b.valid(), c.valid()], lags)

    laid_out = a.valid()
    assert a.columns is None and laid_out.columns is not None and laid_out.valid() is laid_out  # built once
    assert (
        [e.episode_id for e in joined.episodes]
        == [e.episode_id for e in at_once.episodes]
        == ["a-0", "b-0", "b-1", "c-0"]
    )
    assert (joined.num_groups, joined.excluded, joined.loss_tokens) == (at_once.num_groups, 1, 8.0)
    assert joined.positions.sizes == at_once.positions.sizes == (3, 2, 4, 3)
    for name in ("reward", "group_index", "completion_len", "staleness", "oldest", "newest", "counts"):
        assert torch.equal(getattr(joined, name), getattr(at_once, name)), name
    for name in ("input_ids", "targets", "mask", "behaviour", "temperature", "lengths", "starts", "completion_at"):
        assert torch.equal(getattr(joined.positions, name), getattr(at_once.positions, name)), name
    assert joined.group_index.tolist() == [0, 1, 1, 2] and joined.positions.starts.tolist() == [0, 3, 5, 9]


def test_padded_and_packed_micro_batches_hold_the_same_positions_and_scores_land_on_the_completions() -> None:
    positions = Positions.of(
        [[5, 6], [7]], [[8, 9], [10, 11, 12]], [[-1.0, -2.0], [-3.0, -4.0, -5.0]], [[1, 0], [1, 1, 1]], [1.0, 0.5]
    )
    positions = replace(positions, teacher=positions.completion_values([[-0.1, -0.2], [-0.3, -0.4, -0.5]]))
    cpu = torch.device("cpu")

    padded = positions.padded([1, 0], pad_id=0, device=cpu)
    packed = positions.packed([1, 0], device=cpu)

    # sequence 1 (prompt 7, completion 10 11 12) then sequence 0 (prompt 5 6, completion 8 9)
    assert packed.input_ids.tolist() == [[7, 10, 11, 5, 6, 8]]
    assert packed.targets.tolist() == [[10, 11, 12, 6, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]] and packed.seq.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert packed.mask.tolist() == [[1, 1, 1, 0, 1, 0]]
    assert packed.behaviour_logprobs.tolist() == [[-3.0, -4.0, -5.0, 0.0, -1.0, -2.0]]
    assert packed.temperature.tolist() == [[0.5, 0.5, 0.5, 1.0, 1.0, 1.0]]
    assert padded.input_ids.tolist() == [[7, 10, 11], [5, 6, 8]]
    assert padded.attention_mask.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert padded.targets.tolist() == [[10, 11, 12], [6, 8, 9]]
    assert padded.temperature.tolist() == [0.5, 1.0]
    # float32 copies of the given values: compared exactly against their own float32 rounding
    teacher = torch.tensor([[-0.3, -0.4, -0.5, 0.0, -0.1, -0.2]])
    torch.testing.assert_close(packed.teacher, teacher, rtol=0, atol=0)
    torch.testing.assert_close(padded.teacher, teacher.reshape(2, 3), rtol=0, atol=0)


def test_shorter_rows_are_padded_and_masked_and_a_score_list_of_the_wrong_length_is_refused() -> None:
    positions = Positions.of([[5], [6, 7, 8]], [[9], [10]], None, None, [1.0, 1.0])

    padded = positions.padded([0, 1], pad_id=99, device=torch.device("cpu"))

    assert padded.input_ids.tolist() == [[5, 99, 99], [6, 7, 8]]
    assert padded.targets.tolist() == [[9, 99, 99], [7, 8, 10]]
    assert padded.attention_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert padded.mask.tolist() == [[1, 0, 0], [0, 0, 1]]
    with pytest.raises(ValueError, match="per-token values"):
        positions.completion_values([[0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="sequence 0"):
        Positions.of([[]], [[1]], None, None, [1.0])
