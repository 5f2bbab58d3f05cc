"""Agent sessions to episodes (relayrl.rollout.workflows.agent_session): chains of calls whose prompts extend one
another merge into one token sequence; anything else starts a new episode; limits are counted per session."""

from __future__ import annotations

import pytest

from relayrl.rollout.workflows.agent_session import Call, Session, SessionLimitExceeded, SessionLimits

LIMITS = SessionLimits(max_calls=4, max_call_tokens=4, max_session_tokens=10, max_episode_tokens=12)


def _call(prompt: list[int], completion: list[int], version: int = 0) -> Call:
    return Call(prompt, completion, [-0.5] * len(completion), [version] * len(completion), 1, "", [])


def _run(session: Session, prompt: list[int], completion: list[int], version: int = 0) -> None:
    plan = session.plan(prompt, None)
    session.record(plan, _call(prompt, completion, version))


def test_calls_whose_prompts_extend_the_transcript_merge_into_one_sequence_with_masked_gaps() -> None:
    s = Session(LIMITS, 60)

    _run(s, [1, 2], [10, 11], version=3)
    _run(s, [1, 2, 10, 11, 7, 8], [12], version=4)  # the gap 7, 8: the template's end of turn, the user's message

    [chain] = s.chains
    ids, lps, versions, mask = chain.sequence()
    assert ids == [10, 11, 7, 8, 12]
    assert mask == [1, 1, 0, 0, 1]
    assert lps == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert versions == [3, 3, 3, 3, 4]  # gap tokens carry the version of the model turn before them


def test_a_call_that_rewrites_the_history_starts_a_new_episode() -> None:
    s = Session(LIMITS, 60)

    _run(s, [1, 2], [10, 11])
    _run(s, [1, 2, 99, 7], [12])  # the model's answer was replaced by 99

    assert [len(c.calls) for c in s.chains] == [1, 1]
    assert s.chains[1].sequence()[3] == [1]


def test_a_call_that_would_overflow_the_episode_starts_the_next_episode_with_the_transcript_as_prompt() -> None:
    s = Session(SessionLimits(max_calls=4, max_call_tokens=4, max_session_tokens=20, max_episode_tokens=6), 60)
    _run(s, [1], [10, 11, 12, 13])
    long_prompt = [1, 10, 11, 12, 13, 5, 6]  # 6 tokens of the episode used: no room for another sampled token

    plan = s.plan(long_prompt, None)

    assert plan.chain is None and plan.max_new_tokens == 4


def test_the_token_budget_of_a_call_is_the_smallest_of_request_call_session_and_episode_room() -> None:
    s = Session(LIMITS, 60)
    _run(s, [1], [10, 11, 12, 13])
    _run(s, [1, 10, 11, 12, 13, 5], [14, 15, 16, 17])  # 8 tokens generated, episode holds 9

    plan = s.plan([1, 10, 11, 12, 13, 5, 14, 15, 16, 17, 6], 3)

    assert plan.max_new_tokens == 2  # session: 10 - 8 = 2 (episode room 12 - 10 = 2, request 3, call 4)


def test_calls_past_max_calls_or_max_session_tokens_are_refused() -> None:
    s = Session(SessionLimits(max_calls=2, max_call_tokens=4, max_session_tokens=5, max_episode_tokens=12), 60)
    _run(s, [1], [10, 11, 12, 13])
    _run(s, [2], [20])

    with pytest.raises(SessionLimitExceeded, match="max_calls"):
        s.plan([3], None)
    t = Session(SessionLimits(max_calls=9, max_call_tokens=4, max_session_tokens=5, max_episode_tokens=12), 60)
    _run(t, [1], [10, 11, 12, 13])
    _run(t, [2], [20])
    with pytest.raises(SessionLimitExceeded, match="max_session_tokens"):
        t.plan([3], None)


def test_concurrent_calls_on_one_transcript_end_in_separate_episodes() -> None:
    s = Session(LIMITS, 60)
    _run(s, [1], [10])
    a = s.plan([1, 10, 5], None)
    b = s.plan([1, 10, 6], None)  # both extend the same transcript, both in flight

    s.record(a, _call([1, 10, 5], [11]))
    s.record(b, _call([1, 10, 6], [12]))  # the chain now ends in 5, 11: b no longer extends it

    assert [len(c.calls) for c in s.chains] == [2, 1]
    assert s.reserved == 0 and s.generated == 3
