"""The rollout workflow contract: how one dataset row becomes one group of episodes. Torch-free.

A :class:`Workflow` turns a :class:`~relayrl.common.dataset.Prompt` into the episodes of one group, using the
clients in its :class:`WorkflowContext` (inference, reward) and, for multi-turn workflows, a stateful
:class:`Environment` per episode. Built-in workflows and user workflows (``module:function`` or an entry point of
group ``relayrl.workflows``) implement the same protocol, so each is testable without the other services.

Episodes a workflow returns keep the trainer's contract (relayrl.common.episodes): one token sequence per episode
(``completion_token_ids``) in which model tokens have loss mask 1 and the behaviour logprob and weight version
that produced them, and observation or tool tokens have loss mask 0 (logprob 0.0, and the version of the model
turn before them, so that staleness counts from the oldest model token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from relayrl.common.dataset import Prompt
from relayrl.common.pb import episode_pb2

ENTRY_POINT_GROUP = "relayrl.workflows"
ENVIRONMENT_ENTRY_POINT_GROUP = "relayrl.environments"


class GroupFailed(RuntimeError):
    """A workflow's group cannot be completed (a wrong sample count, no model token): rollout retries the group up
    to rollout.max_group_attempts times, then skips and counts it."""


@dataclass
class StepResult:
    """What an environment answers to one model turn."""

    observation: str  # text shown to the model next (empty when the episode ends)
    reward: float = 0.0  # reward of this step; the episode's reward is the sum over its steps
    done: bool = False  # the task ended (solved, failed, game over)
    truncated: bool = False  # the environment cut the episode short (its own step or time limit)
    info: dict[str, Any] = field(default_factory=dict)
    tool_calls: int = 0  # tool calls this step executed (counted on the episode)
    tool_errors: int = 0  # of which failed (unknown tool, bad arguments, an error or a timeout)
    limit: str = ""  # with truncated: the workflow limit that cut the episode ("max_tool_calls"), if any


class Environment(Protocol):
    """A stateful episode over text: ``reset`` gives the first observation (text, or a conversation in the OpenAI
    chat format for a chat model), then each model turn goes to ``step``. One instance per episode; ``close`` is
    always called, also after an error. An exception from ``reset`` or ``step`` is an environment failure: the
    episode is counted and marked like a reward error, never scored 0."""

    async def reset(self, row: Prompt, seed: int) -> str | list[dict[str, str]]: ...

    async def step(self, action: str) -> StepResult: ...

    async def close(self) -> None: ...


# Builds the environment of one episode from its dataset row (loaded from ``module:function`` or an entry point).
EnvironmentFactory = Callable[[Prompt], Environment]


@dataclass
class WorkflowContext:
    """What a workflow may use for one group. Fields may be added (at the end); none is removed or retyped."""

    inference: Any  # relayrl.client.InferenceClient (with rollout's retry policy)
    reward: Any  # relayrl.client.RewardClient
    group_id: str  # stamped on every episode of the group
    group_size: int  # episodes the group must hold (rollout.group_size)
    producer_id: str  # stamped on every episode
    created_at: float  # Unix time the group started
    config: Any = None  # relayrl.config.rollout.RolloutConfig: sampling, timeouts and the per-episode limits
    environment: EnvironmentFactory | None = None  # multi_turn: builds the environment of each episode


class Workflow(Protocol):
    """Turns one dataset row into one group of ``ctx.group_size`` episodes. Raising fails the group (retried up to
    rollout.max_group_attempts, then skipped and counted); a failed score or environment marks the episode."""

    async def __call__(self, row: Prompt, ctx: WorkflowContext) -> list[episode_pb2.Episode]: ...
