"""The step statistics of the metrics row (relayrl.trainer.step_summary.global_summary) on one rank: every figure
summed from the batch's columns (relayrl.trainer.ingest.StepBatch)."""

from __future__ import annotations

import pytest
import torch

from relayrl.common.pb.episode_pb2 import Episode, EpisodeEnd
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.step_summary import global_summary


def _episode(
    reward: float,
    tokens: int,
    versions: list[int],
    end: int = 0,
    turns: int = 0,
    tool_calls: int = 0,
    tool_errors: int = 0,
) -> Episode:
    return Episode(
        reward=reward,
        prompt_token_ids=[2],
        completion_token_ids=[1] * tokens,
        behaviour_logprobs=[-1.0] * tokens,
        loss_mask=[1] * tokens,
        token_weight_versions=versions,
        episode_end=end,
        turns=turns,
        tool_calls=tool_calls,
        tool_errors=tool_errors,
    )


def test_summary_of_mixed_episodes_counts_each_figure_once() -> None:
    episodes = [
        _episode(1.0, 2, [3, 3]),
        _episode(0.0, 3, [2, 3, 3], end=EpisodeEnd.EPISODE_END_DONE, turns=2, tool_calls=1),
        _episode(0.5, 1, [3], end=EpisodeEnd.EPISODE_END_MAX_TURNS, turns=3, tool_calls=2, tool_errors=1),
        _episode(0.5, 2, [1, 2], end=99),  # an end value this trainer does not know counts as single-turn
    ]
    staleness = torch.tensor([0.0, 1.0, 0.0, 2.0])

    summary = global_summary(Collectives(None, 10.0), 1, StepBatch.of(episodes, staleness.tolist(), excluded=2))

    assert summary.episodes == 4 and summary.reward_errors == 2
    # sums of a few exact binary fractions: float64 holds them exactly
    assert summary.reward_mean == pytest.approx(0.5, rel=0, abs=1e-12)
    assert summary.reward_std == pytest.approx((0.375 - 0.25) ** 0.5, rel=0, abs=1e-12)
    assert summary.completion_len_mean == pytest.approx(2.0, rel=0, abs=1e-12)
    assert summary.staleness_mean == pytest.approx(0.75, rel=0, abs=1e-12) and summary.staleness_max == 2
    assert summary.staleness_hist == {"0": 2, "1": 1, "2": 1}  # 2 > max_staleness 1: the overflow bucket
    assert summary.turns_mean == pytest.approx(7 / 4, rel=0, abs=1e-12)  # an unset turn count reads as 1
    assert summary.tool_calls_mean == pytest.approx(3 / 4, rel=0, abs=1e-12) and summary.tool_errors == 1
    assert summary.episodes_multi_version == 2
    assert summary.episode_ends == {"single_turn": 2, "done": 1, "max_turns": 1}


def test_summary_of_no_episodes_is_zero_not_an_error() -> None:
    summary = global_summary(Collectives(None, 10.0), 1, StepBatch.empty())

    assert summary.episodes == 0 and summary.reward_mean == 0.0 and summary.staleness_max == 0
    assert summary.staleness_hist == {} and summary.episode_ends == {}
