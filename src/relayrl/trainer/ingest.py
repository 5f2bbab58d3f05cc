"""The trainer's ingest stage: each stream entry read once, into the facts every later decision uses.

An entry the stream decoded (relayrl.common.stream) enters here once (:meth:`Ingested.of`): its episodes' token
fields are taken as lists once (relayrl.common.episodes.TokenLists), and the facts of its group are computed once
from them: each episode's oldest and newest token version and whether it mixes versions, which episodes' scoring
failed, and whether its valid rewards all agree. Validation (relayrl.common.episodes.validate_group) reads the
same lists. The collector (relayrl.trainer.groups) judges a waiting group from these facts (:func:`judge`, a
:class:`Verdict`) and acts on the verdict; only staleness is judged again while a group waits, since the trainer's
weights move on.

Each group that passes validation has its valid episodes' columns gathered as it arrives (:meth:`Ingested.valid`:
token lists, temperature, reward, versions, the summary's counts; :class:`Columns`), while the collector waits for
the step's other groups. The groups a step takes become one :class:`StepBatch`: their columns joined and laid out
once, for all the batch's episodes together, as host arrays (training positions with token ids, behaviour
logprobs, loss mask, teacher and reference logprobs; per episode reward, group index, temperature, staleness,
oldest and newest version, completion length and the summary's counts) that the tensors share: a few array
operations per batch, where building tensors from per-group Python lists cost several times more
(``python bench/ingest.py``). The learner slices its micro-batches from it (relayrl.trainer.batching.Positions)
and the step summary sums its columns (relayrl.trainer.step_summary); nothing downstream walks an episode's
protobuf fields again.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from relayrl.common.episodes import TokenLists, reward_failed
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.common.stream import StreamEntry
from relayrl.trainer.batching import PerToken, Positions


class Verdict(enum.Enum):
    """What the collector does with a group."""

    OK = "ok"  # trained
    STALE = "stale"  # beyond rollout.max_staleness: dropped and counted
    ZERO_ADVANTAGE = "zero_advantage"  # its valid rewards agree (dynamic sampling): dropped and counted
    REWARD_ERROR = "reward_error"  # every episode's scoring failed: dropped and counted
    INVALID = "invalid"  # fails validation, or a version ahead of the trainer's weights: dead-lettered


def version_facts(lists: Sequence[TokenLists]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
    """Per episode: its oldest and newest token's weight version (0 without tokens) and whether its tokens come
    from several versions."""
    return (
        tuple(min(t.versions, default=0) for t in lists),
        tuple(max(t.versions, default=0) for t in lists),
        tuple(len(set(t.versions)) > 1 for t in lists),
    )


@dataclass(frozen=True)
class Ingested:
    """A decoded stream entry and the facts of its group, computed once."""

    entry: StreamEntry
    lists: tuple[TokenLists, ...]  # per episode
    oldest_each: tuple[int, ...]  # per episode: its oldest token's version (0 without tokens)
    newest_each: tuple[int, ...]
    mixed_each: tuple[bool, ...]  # per episode: its tokens come from several versions
    failed: tuple[int, ...]  # indices of the episodes whose scoring failed
    same_rewards: bool  # its valid episodes' rewards all agree (fewer than two: nothing to compare)
    columns: Columns | None = None  # its valid episodes as columns, once the group passed validation

    @classmethod
    def of(cls, entry: StreamEntry) -> Ingested:
        episodes = entry.group.episodes
        lists = tuple(TokenLists.of(ep) for ep in episodes)
        failed = tuple(i for i, ep in enumerate(episodes) if reward_failed(ep))
        rewards = {ep.reward for i, ep in enumerate(episodes) if i not in failed}
        return cls(entry, lists, *version_facts(lists), failed, len(rewards) <= 1)

    def valid(self) -> Ingested:
        """This group once it passed validation, its valid episodes' columns gathered now: as the group arrives,
        while the collector waits for the step's other groups, so that taking a step's batch only joins them and
        lays the whole batch out once."""
        return self if self.columns is not None else replace(self, columns=self.valid_columns())

    def valid_columns(self) -> Columns:
        """Its valid episodes (scoring did not fail) as columns: those gathered on arrival, or gathered now."""
        if self.columns is not None:
            return self.columns
        keep = [i for i in range(self.size) if i not in self.failed]
        return Columns.of(
            [self.entry.group.episodes[i] for i in keep],
            [self.lists[i] for i in keep],
            (
                [self.oldest_each[i] for i in keep],
                [self.newest_each[i] for i in keep],
                [self.mixed_each[i] for i in keep],
            ),
        )

    @property
    def group_id(self) -> str:
        return self.entry.group.group_id

    @property
    def size(self) -> int:
        return len(self.lists)

    @property
    def oldest(self) -> int:
        return min(self.oldest_each, default=0)

    @property
    def newest(self) -> int:
        return max(self.newest_each, default=0)


def judge(ing: Ingested, lag: int, ahead: int, max_staleness: int, drop_zero_advantage: bool) -> tuple[Verdict, str]:
    """The verdict on a valid group and why: ``lag`` and ``ahead`` are the staleness of its oldest and newest
    token; ``drop_zero_advantage`` whether dynamic sampling may still drop a group this step."""
    if ing.failed and len(ing.failed) == ing.size:
        return Verdict.REWARD_ERROR, "every episode failed scoring"
    if min(lag, ahead) < 0:  # never a negative staleness: a version the lineage places after the trainer's weights
        version = ing.newest if ahead < 0 else ing.oldest
        return Verdict.INVALID, (
            f"token_weight_versions: version {version} is ahead of the trainer's weights (staleness {min(lag, ahead)})"
        )
    if lag > max_staleness:
        return Verdict.STALE, f"staleness {lag} > max_staleness {max_staleness}"
    if drop_zero_advantage and ing.same_rewards:
        return Verdict.ZERO_ADVANTAGE, "every valid episode has the same reward (dynamic sampling)"
    return Verdict.OK, ""


# per-episode counts the step summary sums, as the columns of StepBatch.counts
COUNTS = ("episode_end", "turns", "tool_calls", "tool_errors", "multi_version")


@dataclass(frozen=True)
class Columns:
    """Valid episodes as host lists, one per column, in episode order: what a batch holds of them that does not
    depend on the batch (its staleness and group index do). A group's are gathered once, as it arrives
    (:meth:`Ingested.valid`); a step's batch joins its groups' (:meth:`join`) and lays them out as arrays once, for
    all its episodes together (:meth:`StepBatch.of_columns`): a few array operations per batch, not per group."""

    episodes: list[Episode]
    lists: list[TokenLists]  # their token fields
    temperature: list[float]  # as sampled (0, unset, read as 1)
    reward: list[float]
    oldest: list[int]
    newest: list[int]
    counts: list[tuple[int, ...]]  # per episode, COUNTS
    loss_tokens: int  # completion tokens in the loss (the loss masks summed)

    @classmethod
    def of(
        cls,
        episodes: list[Episode],
        lists: Sequence[TokenLists],
        versions: tuple[Sequence[int], Sequence[int], Sequence[bool]],
    ) -> Columns:
        """One pass over the episodes."""
        oldest, newest, mixed = versions
        return cls(
            episodes=episodes,
            lists=list(lists),
            temperature=[ep.sampling_temperature or 1.0 for ep in episodes],
            reward=[ep.reward for ep in episodes],
            oldest=list(oldest),
            newest=list(newest),
            counts=[
                (ep.episode_end, max(ep.turns, 1), ep.tool_calls, ep.tool_errors, int(m))
                for ep, m in zip(episodes, mixed, strict=True)
            ],
            loss_tokens=sum(map(sum, (t.loss_mask for t in lists))),
        )

    @classmethod
    def join(cls, parts: Sequence[Columns]) -> Columns:
        """These columns one after the other."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            episodes=[v for c in parts for v in c.episodes],
            lists=[v for c in parts for v in c.lists],
            temperature=[v for c in parts for v in c.temperature],
            reward=[v for c in parts for v in c.reward],
            oldest=[v for c in parts for v in c.oldest],
            newest=[v for c in parts for v in c.newest],
            counts=[v for c in parts for v in c.counts],
            loss_tokens=sum(c.loss_tokens for c in parts),
        )

    def positions(self) -> Positions:
        """Their tokens as training positions."""
        lists = self.lists
        return Positions.of(
            [t.prompt for t in lists],
            [t.completion for t in lists],
            [t.behaviour for t in lists],
            [t.loss_mask for t in lists],
            self.temperature,
        )


@dataclass(frozen=True)
class StepBatch:
    """This rank's share of one step: its groups, and their valid episodes as columns (errored ones never reach
    the loss; their groups train on the rest)."""

    entries: list[StreamEntry]  # the groups (stream entries) read
    episodes: list[Episode]  # the valid episodes, in column order (sent to a teacher or reference; audited)
    positions: Positions  # their tokens as training positions, teacher and reference logprobs included
    reward: torch.Tensor  # [N] float64
    group_index: torch.Tensor  # [N] long: index of the episode's group among this batch's
    num_groups: int
    completion_len: torch.Tensor  # [N] float64
    staleness: torch.Tensor  # [N] float32: of the episode's oldest token
    oldest: torch.Tensor  # [N] long
    newest: torch.Tensor  # [N] long
    counts: torch.Tensor  # [N, len(COUNTS)] float64
    loss_tokens: float  # completion tokens in the loss (the loss masks summed)
    excluded: int = 0  # errored episodes of these groups, left out

    def __len__(self) -> int:
        return len(self.episodes)

    @classmethod
    def take(cls, ingested: Sequence[Ingested], lags: Mapping[int, int]) -> StepBatch:
        """The batch of groups the collector took (their columns joined, in order): ``lags`` maps each episode's
        oldest version to its staleness."""
        parts = [ing.valid_columns() for ing in ingested]
        columns = Columns.join(parts)
        sizes = [len(c.episodes) for c in parts if c.episodes]  # groups with an episode
        return cls.of_columns(
            [ing.entry for ing in ingested],
            columns,
            np.repeat(np.arange(len(sizes)), sizes),
            [lags[v] for v in columns.oldest],
            sum(len(ing.failed) for ing in ingested),
        )

    @classmethod
    def of(
        cls,
        episodes: Sequence[Episode],
        staleness: Sequence[float] | None = None,
        teacher: PerToken | None = None,
        reference: PerToken | None = None,
        excluded: int = 0,
    ) -> StepBatch:
        """Episodes as they are (every one trained; no stream entries): for tests, benchmarks and tools."""
        lists = [TokenLists.of(ep) for ep in episodes]
        lags = list(staleness) if staleness is not None else [0.0] * len(episodes)
        groups = {g: i for i, g in enumerate(dict.fromkeys(ep.group_id for ep in episodes))}
        columns = Columns.of(list(episodes), lists, version_facts(lists))
        return cls.of_columns([], columns, [groups[ep.group_id] for ep in episodes], lags, excluded).scored(
            teacher, reference
        )

    @classmethod
    def of_columns(
        cls,
        entries: list[StreamEntry],
        columns: Columns,
        group_index: Sequence[int] | np.ndarray,
        lags: Sequence[float] | np.ndarray,
        excluded: int,
    ) -> StepBatch:
        """The batch of these columns, each episode's group index and staleness beside them: one array each, made
        a tensor that shares its memory."""
        n, index = len(columns.episodes), np.asarray(group_index, np.int64)

        def tensor(values: Any, dtype: Any) -> torch.Tensor:
            return torch.from_numpy(np.asarray(values, dtype))

        return cls(
            entries=entries,
            episodes=columns.episodes,
            positions=columns.positions(),
            reward=tensor(columns.reward, np.float64),
            group_index=torch.from_numpy(index),
            num_groups=int(index.max()) + 1 if n else 0,
            completion_len=torch.from_numpy(np.fromiter((len(t.completion) for t in columns.lists), np.float64, n)),
            staleness=tensor(lags, np.float32),
            oldest=tensor(columns.oldest, np.int64),
            newest=tensor(columns.newest, np.int64),
            counts=tensor(columns.counts, np.float64).reshape(n, len(COUNTS)),
            loss_tokens=float(columns.loss_tokens),
            excluded=excluded,
        )

    @classmethod
    def empty(cls) -> StepBatch:
        return cls.of([])

    def scored(self, teacher: PerToken | None, reference: PerToken | None) -> StepBatch:
        """This batch with a teacher's and a reference's logprobs of each valid episode's completion (either
        None: not scored) as columns of their own."""
        if teacher is None and reference is None:
            return self
        p = self.positions
        return replace(
            self,
            positions=replace(
                p,
                teacher=None if teacher is None else p.completion_values(teacher),
                reference=None if reference is None else p.completion_values(reference),
            ),
        )
