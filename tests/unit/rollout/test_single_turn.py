"""The single-turn workflow's episodes (relayrl.rollout.workflows.single_turn): one Generate of ``group_size``
samples and one ScoreBatch become one group, each episode the group's shared fields plus its own sample and score."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from relayrl.common.dataset import Prompt
from relayrl.common.episodes import Limits, validate_group
from relayrl.common.pb import common_pb2, episode_pb2, inference_pb2, reward_pb2
from relayrl.config.rollout import RolloutConfig
from relayrl.rollout.workflows.api import WorkflowContext
from relayrl.rollout.workflows.single_turn import SingleTurnWorkflow

ROW = Prompt("p7", "2+3=", "5")
PROMPT_IDS = [5, 6, 7, 8]


class Model:
    """Inference's ``generate``: sample i has i + 1 tokens, each stamped with version 10 + i."""

    async def generate(self, prompt: Any, sampling: inference_pb2.SamplingParams, **_: Any) -> Any:
        return inference_pb2.GenerateResponse(
            prompt_token_ids=PROMPT_IDS,
            samples=[
                inference_pb2.Sample(
                    token_ids=[20 + i] * (i + 1),
                    logprobs=[-0.25 * (i + 1)] * (i + 1),
                    weight_versions=[10 + i] * (i + 1),
                    text=f"s{i}",
                    finish_reason=common_pb2.FINISH_REASON_STOP,
                )
                for i in range(sampling.n)
            ],
        )


class Reward:
    """Reward's ``score_batch``: the second request fails; the third reports components."""

    async def score_batch(self, requests: Sequence[reward_pb2.ScoreRequest], **_: Any) -> Any:
        out = [reward_pb2.ScoreResponse(episode_id=r.episode_id, score=1.0) for r in requests]
        out[1] = reward_pb2.ScoreResponse(episode_id=requests[1].episode_id, status=reward_pb2.SCORE_STATUS_ERROR)
        out[1].error = "verifier crashed"
        out[2].components.update({"format": 0.5, "answer": 1.0})
        return reward_pb2.ScoreBatchResponse(responses=out)


async def _group(group_size: int = 4) -> list[episode_pb2.Episode]:
    cfg = RolloutConfig(group_size=group_size, max_new_tokens=8, temperature=0.7)
    cfg.validate()
    ctx = WorkflowContext(Model(), Reward(), "g1", group_size, "producer-a", 123.5, cfg)
    return await SingleTurnWorkflow()(ROW, ctx)


async def test_each_episode_holds_the_groups_shared_fields_and_its_own_samples_tokens_and_score() -> None:
    before = time.time()
    episodes = await _group()

    assert [ep.sample_index for ep in episodes] == [0, 1, 2, 3]
    assert len({ep.episode_id for ep in episodes}) == 4
    for i, ep in enumerate(episodes):
        shared = (ep.prompt_id, ep.group_id, ep.group_size, ep.producer_id, ep.created_at, ep.prompt_text)
        assert shared == ("p7", "g1", 4, "producer-a", 123.5, "2+3=")
        assert list(ep.prompt_token_ids) == PROMPT_IDS
        assert ep.enqueued_at >= before
        assert abs(ep.sampling_temperature - 0.7) < 1e-6  # a float field: 0.7 as float32
        assert list(ep.completion_token_ids) == [20 + i] * (i + 1)
        assert list(ep.behaviour_logprobs) == [-0.25 * (i + 1)] * (i + 1)  # quarters: exact in float32
        assert list(ep.token_weight_versions) == [10 + i] * (i + 1)  # each token's version, as inference stamped it
        assert list(ep.loss_mask) == [1] * (i + 1)
        assert (ep.completion_text, ep.finish_reason) == (f"s{i}", common_pb2.FINISH_REASON_STOP)
    assert [(ep.reward, ep.reward_status) for ep in episodes] == [
        (1.0, reward_pb2.SCORE_STATUS_UNSPECIFIED),
        (0.0, reward_pb2.SCORE_STATUS_ERROR),  # marked failed, never a reward of 0 the trainer trusts
        (1.0, reward_pb2.SCORE_STATUS_UNSPECIFIED),
        (1.0, reward_pb2.SCORE_STATUS_UNSPECIFIED),
    ]
    assert episodes[1].reward_error == "verifier crashed"
    assert [dict(ep.reward_components) for ep in episodes] == [{}, {}, {"format": 0.5, "answer": 1.0}, {}]


async def test_the_group_passes_the_trainers_validation() -> None:
    episodes = await _group()

    group = episode_pb2.EpisodeGroup(group_id="g1", episodes=episodes)
    assert validate_group(group, Limits(vocab_size=64, max_completion_tokens=8, newest_version=13)) is None
