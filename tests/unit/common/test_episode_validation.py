"""The trainer's stream-entry decoder and episode validator (relayrl.common.episodes), by example and by property."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from relayrl.common.episodes import (
    LOGPROB_MAX,
    LOGPROB_MIN,
    TEMPERATURE_MIN,
    EpisodeDecodeError,
    Limits,
    decode_group,
    validate_group,
)
from relayrl.common.pb.episode_pb2 import Episode, EpisodeGroup
from relayrl.common.redis_keys import STREAM_FIELD

LIMITS = Limits(vocab_size=32, max_completion_tokens=4, newest_version=5)


def _group(n: int = 2, tokens: int = 3, gid: str = "g") -> EpisodeGroup:
    return EpisodeGroup(
        group_id=gid,
        episodes=[
            Episode(
                episode_id=f"{gid}-{i}",
                group_id=gid,
                sample_index=i,
                group_size=n,
                prompt_token_ids=[1, 2],
                completion_token_ids=[3] * tokens,
                behaviour_logprobs=[-0.5] * tokens,
                token_weight_versions=[5] * tokens,
                loss_mask=[1] * tokens,
                reward=1.0,
                reward_components={"exact": 1.0},
                sampling_temperature=1.0,
            )
            for i in range(n)
        ],
    )


def test_a_well_formed_group_is_accepted() -> None:
    assert validate_group(_group(), LIMITS) is None


def _short_logprobs(g: EpisodeGroup) -> None:
    del g.episodes[1].behaviour_logprobs[-1]


def _token_outside_vocab(g: EpisodeGroup) -> None:
    g.episodes[0].completion_token_ids[0] = 32


def _negative_token(g: EpisodeGroup) -> None:
    g.episodes[0].prompt_token_ids[0] = -1


def _version_from_the_future(g: EpisodeGroup) -> None:
    g.episodes[0].token_weight_versions[2] = 6


def _negative_version(g: EpisodeGroup) -> None:
    g.episodes[0].token_weight_versions[0] = -1


def _nan_reward(g: EpisodeGroup) -> None:
    g.episodes[1].reward = math.nan


def _inf_component(g: EpisodeGroup) -> None:
    g.episodes[1].reward_components["exact"] = math.inf


def _nan_logprob(g: EpisodeGroup) -> None:
    g.episodes[0].behaviour_logprobs[0] = math.nan


def _huge_negative_logprob(g: EpisodeGroup) -> None:
    g.episodes[0].behaviour_logprobs[0] = -1e30


def _empty_completion(g: EpisodeGroup) -> None:
    for name in ("completion_token_ids", "behaviour_logprobs", "token_weight_versions", "loss_mask"):
        del getattr(g.episodes[0], name)[:]


def _empty_prompt(g: EpisodeGroup) -> None:
    del g.episodes[0].prompt_token_ids[:]


def _loss_mask_two(g: EpisodeGroup) -> None:
    g.episodes[0].loss_mask[0] = 2


def _group_size_lies(g: EpisodeGroup) -> None:
    g.episodes[0].group_size = 3


def _repeated_sample_index(g: EpisodeGroup) -> None:
    g.episodes[1].sample_index = 0


def _foreign_group_id(g: EpisodeGroup) -> None:
    g.episodes[1].group_id = "other"


def _no_episodes(g: EpisodeGroup) -> None:
    del g.episodes[:]


def _negative_temperature(g: EpisodeGroup) -> None:
    g.episodes[0].sampling_temperature = -1.0


def _subnormal_temperature(g: EpisodeGroup) -> None:
    g.episodes[0].sampling_temperature = 1e-40


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_short_logprobs, "behaviour_logprobs"),
        (_token_outside_vocab, "completion_token_ids"),
        (_negative_token, "prompt_token_ids"),
        (_version_from_the_future, "token_weight_versions"),
        (_negative_version, "token_weight_versions"),
        (_nan_reward, "reward"),
        (_inf_component, "reward_components"),
        (_nan_logprob, "behaviour_logprobs"),
        (_huge_negative_logprob, "behaviour_logprobs"),
        (_empty_completion, "completion_token_ids"),
        (_empty_prompt, "prompt_token_ids"),
        (_loss_mask_two, "loss_mask"),
        (_group_size_lies, "group_size"),
        (_repeated_sample_index, "sample_index"),
        (_foreign_group_id, "group_id"),
        (_no_episodes, "episodes"),
        (_negative_temperature, "sampling_temperature"),
        (_subnormal_temperature, "sampling_temperature"),
    ],
)
def test_a_malformed_group_is_refused_with_a_reason_naming_the_field(mutate, field) -> None:  # type: ignore[no-untyped-def]
    group = _group()
    mutate(group)

    reason = validate_group(group, LIMITS)

    assert reason is not None and field in reason


def test_a_completion_longer_than_max_new_tokens_is_refused() -> None:
    assert "max_new_tokens" in str(validate_group(_group(tokens=5), LIMITS))


@pytest.mark.parametrize(
    "fields", [None, {}, {b"other": b"x"}, {STREAM_FIELD: "text"}, {STREAM_FIELD: b"\xff\xff\xff"}]
)
def test_entries_without_a_decodable_group_raise_the_decoders_own_error(fields) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EpisodeDecodeError):
        decode_group(fields)


def _invariants_hold(group: EpisodeGroup, limits: Limits) -> bool:
    """What the trainer relies on, stated independently of the validator's code."""
    n = len(group.episodes)
    if n == 0 or sorted(ep.sample_index for ep in group.episodes) != list(range(n)):
        return False
    for ep in group.episodes:
        k = len(ep.completion_token_ids)
        ids = [*ep.prompt_token_ids, *ep.completion_token_ids]
        if not (
            ep.group_id == group.group_id
            and ep.group_size == n
            and ep.prompt_token_ids
            and 1 <= k <= limits.max_completion_tokens
            and all(0 <= t < limits.vocab_size for t in ids)
            and len(ep.behaviour_logprobs) == len(ep.token_weight_versions) == len(ep.loss_mask) == k
            and all(math.isfinite(x) and LOGPROB_MIN <= x <= LOGPROB_MAX for x in ep.behaviour_logprobs)
            and all(0 <= v <= limits.newest_version for v in ep.token_weight_versions)
            and set(ep.loss_mask) <= {0, 1}
            and math.isfinite(ep.reward)
            and all(math.isfinite(x) for x in ep.reward_components.values())
            and (ep.sampling_temperature == 0 or TEMPERATURE_MIN <= ep.sampling_temperature < math.inf)
        ):
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.dictionaries(st.binary(max_size=8), st.binary(max_size=64), max_size=4)))
def test_arbitrary_bytes_or_fields_decode_or_raise_only_the_decoder_error(data: bytes | dict[bytes, bytes]) -> None:
    fields = {STREAM_FIELD: data} if isinstance(data, bytes) else data
    try:
        group = decode_group(fields)
    except EpisodeDecodeError:
        return
    reason = validate_group(group, LIMITS)  # never raises, whatever the decoder let through
    assert reason is None or isinstance(reason, str)
    assert (reason is None) == _invariants_hold(group, LIMITS)


_FIELDS = [
    "group_id",
    "sample_index",
    "group_size",
    "prompt_token_ids",
    "completion_token_ids",
    "behaviour_logprobs",
    "token_weight_versions",
    "loss_mask",
    "reward",
    "reward_components",
    "sampling_temperature",
]
_f32 = st.floats(width=32)
_ints = st.integers(min_value=-3, max_value=40)


def _arbitrary(field: str, k: int) -> st.SearchStrategy:  # type: ignore[type-arg]
    """Any value of the field's protobuf type (often invalid, sometimes valid), length around ``k``."""
    sized = {"min_size": max(k - 1, 0), "max_size": k + 1}
    return {
        "group_id": st.sampled_from(["g", "x", ""]),
        "sample_index": st.integers(0, 4),
        "group_size": st.integers(0, 4),
        "prompt_token_ids": st.lists(_ints, max_size=3),
        "completion_token_ids": st.lists(_ints, **sized),
        "behaviour_logprobs": st.lists(_f32, **sized),
        "token_weight_versions": st.lists(st.integers(-2, 8), **sized),
        "loss_mask": st.lists(st.integers(0, 2), **sized),
        "reward": st.floats(),
        "reward_components": st.dictionaries(st.sampled_from(["a", "b"]), st.floats(), max_size=2),
        "sampling_temperature": _f32,
    }[field]


@st.composite
def _groups(draw: st.DrawFn) -> EpisodeGroup:
    """A well-formed group (random sizes and in-range values) with 0 to 2 fields replaced by arbitrary values."""
    n, k = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    group = _group(n=n, tokens=k)
    for ep in group.episodes:
        ep.completion_token_ids[:] = draw(st.lists(st.integers(0, 31), min_size=k, max_size=k))
        ep.behaviour_logprobs[:] = draw(st.lists(st.floats(-20, 0, width=32), min_size=k, max_size=k))
        ep.token_weight_versions[:] = draw(st.lists(st.integers(0, 5), min_size=k, max_size=k))
        ep.loss_mask[:] = draw(st.lists(st.integers(0, 1), min_size=k, max_size=k))
    for _ in range(draw(st.integers(0, 2))):
        ep, name = draw(st.sampled_from(list(group.episodes))), draw(st.sampled_from(_FIELDS))
        value = draw(_arbitrary(name, k))
        if isinstance(value, (list, dict)):
            ep.ClearField(name)
            getattr(ep, name).update(value) if isinstance(value, dict) else getattr(ep, name).extend(value)
        else:
            setattr(ep, name, value)
    if draw(st.integers(0, 9)) == 0:
        del group.episodes[:]
    return group


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_groups())
def test_every_accepted_group_satisfies_the_invariants_and_every_refused_one_breaks_one(group: EpisodeGroup) -> None:
    reason = validate_group(group, LIMITS)
    event("accepted" if reason is None else "refused")  # --hypothesis-show-statistics: both sides are exercised

    assert (reason is None) == _invariants_hold(group, LIMITS), reason
    assert decode_group({STREAM_FIELD: group.SerializeToString()}) == group  # the round trip the stream makes
