"""What one agent session records, and how the record becomes episodes. Pure logic: no I/O, no torch.

Every chat completion call of a session is recorded with the prompt ids the model saw, the sampled ids, their
behaviour logprobs and weight versions (:class:`Call`). Calls are grouped into chains (:class:`Chain`): a call
joins the chain whose tokens so far (the last call's prompt followed by its completion) are a prefix of its own
prompt ids. Each chain becomes one episode: the first call's prompt is the episode's prompt, and its completion
sequence is every call's sampled tokens (loss mask 1) with the tokens between them (the rest of each later prompt:
the template's end of turn, the user's or tool's next message; loss mask 0, logprob 0.0, the version of the model
token before them). A call that extends no chain starts one: a session whose agent rewrites its history (or whose
chat template re-renders earlier turns differently) gives one episode per call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


class SessionLimitExceeded(ValueError):
    """A call over one of the session's limits (answered 413)."""


@dataclass(frozen=True)
class SessionLimits:
    max_calls: int  # chat completion calls per session
    max_call_tokens: int  # tokens one call may generate
    max_session_tokens: int  # tokens all calls of a session may generate
    max_episode_tokens: int  # completion sequence of one episode (sampled + gap tokens): what the trainer accepts


@dataclass(frozen=True)
class Call:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: int
    text: str
    messages: list[dict[str, Any]]  # the request's messages (for the episode's prompt text)


@dataclass
class Chain:
    """Calls whose prompts extend one another: one episode."""

    calls: list[Call] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        last = self.calls[-1]
        return last.prompt_ids + last.completion_ids

    def extended_by(self, prompt_ids: list[int]) -> bool:
        tokens = self.tokens
        return len(prompt_ids) >= len(tokens) and prompt_ids[: len(tokens)] == tokens

    def used_by(self, prompt_ids: list[int]) -> int:
        """Tokens of the episode's completion sequence before a call with this prompt samples."""
        return len(prompt_ids) - len(self.calls[0].prompt_ids)

    def sequence(self) -> tuple[list[int], list[float], list[int], list[int]]:
        """The episode's completion ids, behaviour logprobs, weight versions and loss mask."""
        ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        mask: list[int] = []
        previous: Call | None = None
        for call in self.calls:
            if previous is not None:
                gap = call.prompt_ids[len(previous.prompt_ids) + len(previous.completion_ids) :]
                version = previous.versions[-1] if previous.versions else (versions[-1] if versions else 0)
                ids += gap
                lps += [0.0] * len(gap)
                versions += [version] * len(gap)
                mask += [0] * len(gap)
            ids += call.completion_ids
            lps += call.logprobs
            versions += call.versions
            mask += [1] * len(call.completion_ids)
            previous = call
        return ids, lps, versions, mask


@dataclass
class Plan:
    """Where a call goes before it samples: the chain it extends (None: a new one) and its token budget."""

    chain: Chain | None
    max_new_tokens: int


class Session:
    """One agent's conversation(s) with the model: its calls, chains, limits and state."""

    def __init__(self, limits: SessionLimits, timeout_s: float) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + timeout_s
        self.calls: list[Call] = []
        self.chains: list[Chain] = []
        self.closed = False
        self.generated = 0  # tokens sampled by recorded calls
        self.reserved = 0  # tokens calls in flight may still sample
        self.started = 0  # calls admitted (recorded or in flight)

    def tails(self) -> list[list[int]]:
        """The tokens of each chain so far, newest chain first (candidate prefixes of the next prompt)."""
        return [c.tokens for c in reversed(self.chains)]

    def plan(self, prompt_ids: list[int], requested: int | None) -> Plan:
        """Admit a call (counting it against the limits) or raise :class:`SessionLimitExceeded`."""
        lim = self.limits
        if self.started >= lim.max_calls:
            raise SessionLimitExceeded(f"the session made its {lim.max_calls} calls (max_calls)")
        left = lim.max_session_tokens - self.generated - self.reserved
        if left < 1:
            raise SessionLimitExceeded(
                f"the session generated its {lim.max_session_tokens} tokens (max_session_tokens)"
            )
        chain = next((c for c in reversed(self.chains) if c.extended_by(prompt_ids)), None)
        room = lim.max_episode_tokens
        if chain is not None:
            room = lim.max_episode_tokens - chain.used_by(prompt_ids)
            if room < 1:  # the episode is full: this call starts the next one (its prompt holds the transcript)
                chain, room = None, lim.max_episode_tokens
        budget = min(requested or lim.max_call_tokens, lim.max_call_tokens, left, room)
        self.started += 1
        self.reserved += budget
        return Plan(chain, budget)

    def record(self, plan: Plan, call: Call) -> None:
        """Add a sampled call to its chain (a new one when a concurrent call extended the planned chain first)."""
        self.reserved -= plan.max_new_tokens
        self.generated += len(call.completion_ids)
        self.calls.append(call)
        chain = plan.chain
        if chain is None or not chain.extended_by(call.prompt_ids):
            chain = Chain()
            self.chains.append(chain)
        chain.calls.append(call)

    def release(self, plan: Plan) -> None:
        """A planned call that failed before it sampled: its budget is free again (it still counts as a call)."""
        self.reserved -= plan.max_new_tokens

    @property
    def final_text(self) -> str:
        """The last answer the model gave in this session (what the reward service scores)."""
        return self.calls[-1].text if self.calls else ""
