"""One multi-turn episode as one token sequence (token-in/token-out), and its conversion to an Episode. Torch-free.

Each model turn's sampled ids are appended exactly as inference returned them, with their behaviour logprobs and
the weight version of each token (loss mask 1); each observation's ids are the ones inference tokenized and
appended after them (``GenerateRequest.suffix_text``), with loss mask 0, logprob 0.0 and the version of the model
turn before them. Nothing is ever re-rendered, so the trainer sees the ids the model saw.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.common.dataset import Prompt
from relayrl.common.episodes import reward_of
from relayrl.common.pb import episode_pb2, inference_pb2, reward_pb2
from relayrl.common.reward_metadata import encode_metadata
from relayrl.rollout.workflows.api import WorkflowContext

EpisodeEnd = episode_pb2.EpisodeEnd


@dataclass
class Trajectory:
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # model turns and observations, in order
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float = 0.0
    end: int = EpisodeEnd.EPISODE_END_UNSPECIFIED
    finish_reason: int = 0  # of the last model turn
    error: str = ""  # the environment's failure, when end is EPISODE_END_ENV_ERROR
    last_text: str = ""  # the last model turn's text

    def context(self) -> list[int]:
        """The exact ids of the episode so far: the next turn's prompt."""
        return [*self.prompt_ids, *self.ids]

    def add_model_turn(self, sample: inference_pb2.Sample, room: int) -> None:
        """Append one sampled turn (at most ``room`` tokens of it; a longer one is cut, its prefix stays valid)."""
        n = min(len(sample.token_ids), room)
        self.ids += sample.token_ids[:n]
        self.logprobs += sample.logprobs[:n]
        self.versions += sample.weight_versions[:n]
        self.mask += [1] * n
        self.texts.append(sample.text)
        self.last_text = sample.text
        self.finish_reason = sample.finish_reason
        self.turns += 1

    def add_observation(self, ids: Sequence[int], text: str) -> None:
        """Append an observation's ids: not trained on, stamped with the version of the model turn before them."""
        version = self.versions[-1] if self.versions else 0
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.mask += [0] * len(ids)
        self.texts.append(text)

    def transcript(self) -> str:
        return "".join(self.texts)


def episode_from(
    traj: Trajectory,
    row: Prompt,
    ctx: WorkflowContext,
    index: int,
    episode_id: str,
    score: reward_pb2.ScoreResponse | None = None,
) -> episode_pb2.Episode:
    """The Episode of one finished trajectory; ``score`` (the reward service's) replaces the environment's reward,
    and an environment failure marks the episode like a reward error."""
    if traj.end == EpisodeEnd.EPISODE_END_ENV_ERROR:
        status, reward, error, components = reward_pb2.SCORE_STATUS_ERROR, 0.0, traj.error, {}
    elif score is not None:
        status, reward, error, components = score.status, reward_of(score), score.error, dict(score.components)
    else:
        status, reward, error, components = reward_pb2.SCORE_STATUS_OK, traj.reward, "", {}
    temperature = ctx.config.temperature if ctx.config is not None else 1.0
    return episode_pb2.Episode(
        episode_id=episode_id,
        prompt_id=row.prompt_id,
        group_id=ctx.group_id,
        sample_index=index,
        group_size=ctx.group_size,
        prompt_token_ids=traj.prompt_ids,
        completion_token_ids=traj.ids,
        behaviour_logprobs=traj.logprobs,
        token_weight_versions=traj.versions,
        loss_mask=traj.mask,
        reward=reward,
        reward_components=components,
        reward_status=status,
        reward_error=error,
        finish_reason=traj.finish_reason,
        producer_id=ctx.producer_id,
        created_at=ctx.created_at,
        enqueued_at=time.time(),
        prompt_text=traj.prompt_text,
        completion_text=traj.transcript(),
        sampling_temperature=temperature,
        episode_end=traj.end,
        turns=traj.turns,
        tool_calls=traj.tool_calls,
        tool_errors=traj.tool_errors,
    )


def score_metadata(row: Prompt, traj: Trajectory) -> dict[str, str]:
    """What a reward function sees of a multi-turn episode beside its final answer (JSON values, as for any
    metadata): the whole transcript, the number of turns and tool calls, and how the episode ended."""
    meta: dict[str, Any] = {
        **row.metadata,
        "transcript": traj.transcript(),
        "turns": traj.turns,
        "tool_calls": traj.tool_calls,
        "tool_errors": traj.tool_errors,
        "episode_end": EpisodeEnd.Name(traj.end).removeprefix("EPISODE_END_").lower(),
    }
    return encode_metadata(meta)
