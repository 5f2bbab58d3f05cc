"""Decoding and validating one stream entry (an episode group) before the trainer trusts it. Torch-free.

An entry comes from Redis, which anything holding the Redis credentials (or a buggy producer) can write to, so
the trainer checks each group before it trains on it: :func:`decode_group` turns the entry's fields into an
:class:`EpisodeGroup` or raises :class:`EpisodeDecodeError` (never anything else), and :func:`validate_group`
returns ``None`` for a group the trainer may train on, or a reason that names the offending field. The trainer
moves an entry that fails either to the dead-letter stream (relayrl.trainer.groups).

Rules (per episode, ``Limits`` from the run config, the model and the version counter):

- the group holds at least one episode; every episode carries the group's ``group_id``; ``group_size`` equals
  the number of episodes and the ``sample_index`` values are distinct and below it;
- ``prompt_token_ids`` and ``completion_token_ids`` are non-empty, the completion at most
  ``max_completion_tokens`` long (rollout.max_new_tokens; for a multi-turn workflow rollout.max_episode_tokens, model
  and observation tokens together), and every id in ``[0, vocab_size)``;
- ``behaviour_logprobs``, ``token_weight_versions`` and ``loss_mask`` have the completion's length;
  logprobs are finite and in ``[LOGPROB_MIN, LOGPROB_MAX]`` (a log-probability; see the constants); loss-mask
  values are 0 or 1;
- weight versions are ``>= 0`` and not newer than ``newest_version``, the last version the trainer allocated
  (a version from the future would otherwise count as a negative staleness);
- ``reward``, every reward component and ``sampling_temperature`` are finite; the temperature is 0 (unset,
  read as 1) or at least ``TEMPERATURE_MIN``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from google.protobuf.message import DecodeError

from relayrl.common.pb import reward_pb2
from relayrl.common.pb.episode_pb2 import Episode, EpisodeEnd, EpisodeGroup
from relayrl.common.redis_keys import STREAM_FIELD

# A sampled token's log-probability is log(p) for p > 0 in float32: at least log(1.4e-45) ~= -103.3, so anything
# below -110 was never sampled; above 0 it is not a probability (1e-5 leaves room for rounding of other engines).
LOGPROB_MIN = -110.0
LOGPROB_MAX = 1e-5
# what a score status says: the score is a reward (OK; UNSPECIFIED, from a producer or reward that predates the
# field, reads as OK); anything else (ERROR, TIMEOUT) means the reward failed, and its score is no reward
SCORED = frozenset({reward_pb2.SCORE_STATUS_OK, reward_pb2.SCORE_STATUS_UNSPECIFIED})


def score_ok(status: int) -> bool:
    """Whether a ``ScoreStatus`` (of a reward's answer, or an episode's ``reward_status``) carries a reward: the one
    rule of rollout, the trainer and evaluation."""
    return status in SCORED


def reward_failed(ep: Episode) -> bool:
    """Whether scoring this episode failed (the trainer excludes and counts it; it is never a reward of 0)."""
    return not score_ok(ep.reward_status)


def reward_of(resp: reward_pb2.ScoreResponse) -> float:
    """The reward of a reward service's answer: its score, or 0.0 where scoring failed (the episode says so by
    its ``reward_status``; the trainer never trains on that 0)."""
    return resp.score if score_ok(resp.status) else 0.0


# The trainer divides logits by the temperature: a forged subnormal one (1e-40) turns them into inf and the loss into
# NaN. No useful sampler runs colder than this.
TEMPERATURE_MIN = 1e-4


def end_name(end: int) -> str:
    """How an episode ended, as metrics and status name it: ``done``, ``max_turns``, ... for an EpisodeEnd value
    (``single_turn`` for UNSPECIFIED, which single-turn episodes carry)."""
    if end == EpisodeEnd.EPISODE_END_UNSPECIFIED:
        return "single_turn"
    return EpisodeEnd.Name(end).removeprefix("EPISODE_END_").lower()


class EpisodeDecodeError(ValueError):
    """A stream entry that does not hold one decodable episode group."""


@dataclass(frozen=True)
class Limits:
    vocab_size: int  # token ids in [0, vocab_size)
    max_completion_tokens: int  # rollout.episode_token_cap(): max_new_tokens, or max_episode_tokens if multi-turn
    newest_version: int  # the last weight version allocated (the version counter)


def decode_group(fields: Mapping[Any, Any] | None) -> EpisodeGroup:
    """The group an entry's fields hold, or :class:`EpisodeDecodeError` saying why not."""
    if not isinstance(fields, Mapping) or STREAM_FIELD not in fields:
        raise EpisodeDecodeError(f"no '{STREAM_FIELD.decode()}' field")
    payload = fields[STREAM_FIELD]
    if not isinstance(payload, bytes):
        raise EpisodeDecodeError(f"'{STREAM_FIELD.decode()}' is not bytes")
    try:
        return EpisodeGroup.FromString(payload)
    except (DecodeError, RuntimeError, ValueError, RecursionError) as exc:  # the C and Python decoders differ
        raise EpisodeDecodeError(f"'{STREAM_FIELD.decode()}' is not an EpisodeGroup: {exc}") from None


def _finite(values: Any) -> bool:
    return all(map(math.isfinite, values))


class TokenLists(NamedTuple):
    """An episode's repeated token fields as lists, taken once: iterating a protobuf container costs about a
    microsecond to start, more than the few values of a typical completion. Validation and the trainer's columns
    (relayrl.trainer.ingest) read these. Each is taken by slicing (``[:]``), which upb copies in C: ``list()``
    iterates the container through Python's iterator protocol, 2-4x slower on a short field. A named tuple: a
    frozen dataclass's constructor costs three times as much, once per episode."""

    prompt: list[int]
    completion: list[int]
    behaviour: list[float]
    versions: list[int]
    loss_mask: list[int]

    @classmethod
    def of(cls, ep: Episode) -> TokenLists:
        return cls(
            ep.prompt_token_ids[:],
            ep.completion_token_ids[:],
            ep.behaviour_logprobs[:],
            ep.token_weight_versions[:],
            ep.loss_mask[:],
        )


def _tokens(t: TokenLists, limits: Limits) -> str | None:
    n = len(t.completion)
    if not t.prompt:
        return "prompt_token_ids: empty"
    if n == 0:
        return "completion_token_ids: empty"
    if n > limits.max_completion_tokens:
        return (
            f"completion_token_ids: {n} tokens > the episode cap {limits.max_completion_tokens} "
            "(rollout.max_new_tokens, or rollout.max_episode_tokens for a multi-turn workflow)"
        )
    for name, ids in (("prompt_token_ids", t.prompt), ("completion_token_ids", t.completion)):
        if min(ids) < 0 or max(ids) >= limits.vocab_size:
            return f"{name}: id outside [0, {limits.vocab_size})"
    for name, values in (
        ("behaviour_logprobs", t.behaviour),
        ("token_weight_versions", t.versions),
        ("loss_mask", t.loss_mask),
    ):
        if len(values) != n:
            return f"{name}: length {len(values)} != completion_token_ids length {n}"
    return None


def _values(ep: Episode, t: TokenLists, limits: Limits) -> str | None:
    logprobs, versions = t.behaviour, t.versions
    if not _finite(logprobs):
        return "behaviour_logprobs: not finite"
    if min(logprobs) < LOGPROB_MIN or max(logprobs) > LOGPROB_MAX:
        return f"behaviour_logprobs: outside [{LOGPROB_MIN}, {LOGPROB_MAX}]"
    if not set(t.loss_mask) <= {0, 1}:
        return "loss_mask: value other than 0 or 1"
    if min(versions) < 0:
        return "token_weight_versions: negative version"
    if max(versions) > limits.newest_version:
        return (
            f"token_weight_versions: version {max(versions)} is newer than the newest allocated {limits.newest_version}"
        )
    if not math.isfinite(ep.reward):
        return "reward: not finite"
    if ep.reward_components and not _finite(ep.reward_components.values()):  # usually empty: its view costs a µs
        return "reward_components: not finite"
    temp = ep.sampling_temperature
    if not math.isfinite(temp) or (temp != 0 and temp < TEMPERATURE_MIN):
        return f"sampling_temperature: not finite, or neither 0 (unset) nor >= {TEMPERATURE_MIN}"
    return None


def validate_episode(ep: Episode, limits: Limits, lists: TokenLists | None = None) -> str | None:
    """None if the trainer may train on ``ep``, else the reason (naming the field). ``lists``: its token lists,
    where the caller took them already."""
    t = lists or TokenLists.of(ep)
    return _tokens(t, limits) or _values(ep, t, limits)


def validate_group(group: EpisodeGroup, limits: Limits, lists: Sequence[TokenLists] | None = None) -> str | None:
    """None if the trainer may train on ``group``, else the reason (naming the field and, where one is to
    blame, the episode's index). ``lists``: its episodes' token lists, where the caller took them already."""
    n = len(group.episodes)
    if n == 0:
        return "episodes: empty group"
    indices, group_id = set(), group.group_id
    for i, ep in enumerate(group.episodes):
        if ep.group_id != group_id:
            return f"episodes[{i}].group_id: differs from the group's"
        if ep.group_size != n:
            return f"episodes[{i}].group_size: {ep.group_size} != {n} episodes"
        index = ep.sample_index
        if index >= n or index in indices:
            return f"episodes[{i}].sample_index: {index} out of range or repeated"
        indices.add(index)
        reason = validate_episode(ep, limits, None if lists is None else lists[i])
        if reason is not None:
            return f"episodes[{i}].{reason}"
    return None
