"""AgentWorkflow: black-box agents as a rollout workflow.

For each of a group's ``group_size`` slots the workflow opens one session on the session proxy (agent_proxy.py)
and calls the agent function with the session's base URL and the dataset row; all slots run at once. The agent
talks to the model only through that URL (the official ``openai`` client works unchanged) and returns a reward
(or None). When it returns, raises or runs out of time, its session closes (later calls get 404) and its calls
become episodes (agent_session.py): one per chain of calls whose prompts extend one another, so a session usually
gives one episode, and one per call where the history was rewritten. Every episode of a session carries the
session's reward, and the group holds the episodes of all its sessions (``group_size`` of each episode: their
number, which may exceed ``ctx.group_size``; advantages are normalised over them).

Reward (``agents.reward``): the agent's return value, or the reward service's score of the session's last answer
against the row's answer. An agent that raises, returns an invalid value, or returns None where only the agent
decides marks its episodes ERROR; one past ``session_timeout_s`` TIMEOUT: they are appended, and the trainer
excludes and counts them (no episode is lost). A group in which no session made a call fails (it is retried).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.client.inference_pool import pinned
from relayrl.common.dataset import Prompt
from relayrl.common.episodes import reward_of
from relayrl.common.pb import episode_pb2, reward_pb2
from relayrl.common.plugins import load_callable
from relayrl.common.reward_metadata import encode_metadata
from relayrl.config.agents import AgentConfig, AgentReward
from relayrl.config.rollout import RolloutConfig
from relayrl.config.typed import ConfigError
from relayrl.rollout.workflows.agent_chat import Renderer
from relayrl.rollout.workflows.agent_proxy import Sampling, SessionProxy
from relayrl.rollout.workflows.agent_session import Call, Session, SessionLimits
from relayrl.rollout.workflows.api import WorkflowContext

log = logging.getLogger(__name__)

AgentFn = Callable[[str, Prompt], Awaitable[float | None]]
AGENT_ENTRY_POINT_GROUP = "relayrl.agents"


def load_agent(spec: str, field_name: str = "rollout.agent.function") -> AgentFn:
    """Import the agent ``module:function`` (or an entry point of group ``relayrl.agents``); errors name the config
    field."""
    fn = load_callable(spec, AGENT_ENTRY_POINT_GROUP, field_name)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(field_name, spec, "must be an async function")
    return fn  # type: ignore[no-any-return]


@dataclass
class Outcome:
    """How one session ended."""

    session: Session
    reward: float = 0.0
    status: int = reward_pb2.SCORE_STATUS_OK
    error: str = ""
    components: dict[str, float] = field(default_factory=dict)
    needs_score: bool = False


class AgentWorkflow:
    """A :class:`~relayrl.rollout.workflows.api.Workflow` running black-box agents (see the module docstring).

    ``tokenizer``: the served model's tokenizer (``relayrl.common.model.load_tokenizer(model.path)``), used to
    render conversations; ``max_episode_tokens``: the longest completion sequence the trainer accepts
    (``rollout.episode_token_cap()``). Call :meth:`close` when done (it stops the proxy)."""

    def __init__(
        self,
        cfg: AgentConfig,
        tokenizer: Any,
        sampling: Sampling,
        max_episode_tokens: int,
        score_timeout_s: float = 60.0,
        agent: AgentFn | None = None,
    ) -> None:
        cfg.validate()
        if agent is None and not cfg.function:
            raise ConfigError("rollout.agent.function", cfg.function, "an agent workflow needs an agent function")
        self.cfg = cfg
        self.agent = agent or load_agent(cfg.function)
        self.sampling = sampling
        self.limits = SessionLimits(
            cfg.max_calls, min(cfg.max_call_tokens, max_episode_tokens), cfg.max_session_tokens, max_episode_tokens
        )
        self.score_timeout_s = score_timeout_s
        self.proxy = SessionProxy(cfg, Renderer(tokenizer), sampling)
        self.sessions_run = 0
        self.sessions_failed = 0  # the agent raised, or returned no valid reward where it had to
        self.sessions_timed_out = 0

    @classmethod
    def from_config(cls, cfg: AgentConfig, rollout: RolloutConfig, model_path: Path) -> AgentWorkflow:
        """The workflow of a run: the agent ``cfg.function``, the rollout's sampling and deadlines, the tokenizer of
        the served model (``model.path``), episodes no longer than ``rollout.max_episode_tokens`` (the trainer's
        limit)."""
        from relayrl.common.model import load_tokenizer

        sampling = Sampling(
            rollout.temperature, rollout.top_p, rollout.top_k, tuple(rollout.stop), rollout.generate_timeout_s
        )
        return cls(cfg, load_tokenizer(model_path), sampling, rollout.episode_token_cap(), rollout.score_timeout_s)

    async def close(self) -> None:
        await self.proxy.stop()

    async def __call__(self, row: Prompt, ctx: WorkflowContext) -> list[episode_pb2.Episode]:
        await self.proxy.start()
        outcomes = await asyncio.gather(*(self._session(row, ctx) for _ in range(ctx.group_size)))
        await self._score(row, ctx, [o for o in outcomes if o.needs_score and o.session.calls])
        return self._episodes(row, ctx, outcomes)

    async def _session(self, row: Prompt, ctx: WorkflowContext) -> Outcome:
        session = Session(self.limits, self.cfg.session_timeout_s)
        sid, url = self.proxy.open(session, pinned(ctx.inference), ctx.group_id)  # one replica while it serves
        self.sessions_run += 1
        out = Outcome(session)
        try:
            value = await asyncio.wait_for(self.agent(url, row), self.cfg.session_timeout_s)
        except TimeoutError:
            self.sessions_timed_out += 1
            out.status, out.error = (
                reward_pb2.SCORE_STATUS_TIMEOUT,
                (f"the agent ran past session_timeout_s={self.cfg.session_timeout_s}"),
            )
            return out
        except Exception as exc:  # the agent's failure marks its episodes; it never fails the group
            self.sessions_failed += 1
            log.warning("agent session of group %s failed: %s", ctx.group_id, type(exc).__name__)
            out.status, out.error = reward_pb2.SCORE_STATUS_ERROR, f"the agent raised {type(exc).__name__}"
            return out
        finally:
            self.proxy.close(sid)
        return self._reward(out, value)

    def _reward(self, out: Outcome, value: object) -> Outcome:
        mode = self.cfg.reward
        if mode is AgentReward.REWARD_SERVICE or (value is None and mode is AgentReward.AUTO):
            out.needs_score = True
            return out
        if value is None:
            self.sessions_failed += 1
            out.status, out.error = reward_pb2.SCORE_STATUS_ERROR, "the agent returned no reward (reward: agent)"
        elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            self.sessions_failed += 1
            out.status, out.error = (
                reward_pb2.SCORE_STATUS_ERROR,
                (f"the agent returned {type(value).__name__}, not a finite number"),
            )
        else:
            out.reward = float(value)
        return out

    async def _score(self, row: Prompt, ctx: WorkflowContext, outcomes: list[Outcome]) -> None:
        """The reward service's score of each session's last answer (one ScoreBatch call)."""
        if not outcomes:
            return
        meta = encode_metadata(row.metadata)
        requests = [
            reward_pb2.ScoreRequest(
                episode_id=uuid.uuid4().hex,
                prompt=row.prompt,
                completion=o.session.final_text,
                reference=row.answer,
                metadata=meta,
            )
            for o in outcomes
        ]
        resp = await ctx.reward.score_batch(requests, timeout_s=self.score_timeout_s)
        if len(resp.responses) != len(outcomes):
            raise RuntimeError(f"reward returned {len(resp.responses)} scores for {len(outcomes)} sessions")
        for o, r in zip(outcomes, resp.responses, strict=True):
            o.status, o.error = r.status, r.error
            o.reward = reward_of(r)
            o.components = dict(r.components)

    def _episodes(self, row: Prompt, ctx: WorkflowContext, outcomes: list[Outcome]) -> list[episode_pb2.Episode]:
        now = time.time()
        episodes: list[episode_pb2.Episode] = []
        for o in outcomes:
            for chain in o.session.chains:
                ids, lps, versions, mask = chain.sequence()
                first, last = chain.calls[0], chain.calls[-1]
                episodes.append(
                    episode_pb2.Episode(
                        episode_id=uuid.uuid4().hex,
                        prompt_id=row.prompt_id,
                        group_id=ctx.group_id,
                        sample_index=len(episodes),
                        prompt_token_ids=first.prompt_ids,
                        completion_token_ids=ids,
                        behaviour_logprobs=lps,
                        token_weight_versions=versions,
                        loss_mask=mask,
                        reward=o.reward,
                        reward_components=o.components,
                        reward_status=o.status,
                        reward_error=o.error,
                        finish_reason=last.finish_reason,
                        producer_id=ctx.producer_id,
                        created_at=ctx.created_at,
                        enqueued_at=now,
                        prompt_text=json.dumps(first.messages, ensure_ascii=False),
                        completion_text="".join(c.text for c in chain.calls),
                        sampling_temperature=self.sampling.temperature,
                        episode_end=_end(o.status),
                        turns=len(chain.calls),
                        tool_calls=_tool_results(last) - _tool_results(first),
                    )
                )
        if not episodes:
            raise RuntimeError(f"no agent session of group {ctx.group_id} called the model")
        for ep in episodes:
            ep.group_size = len(episodes)
        return episodes


def _end(status: int) -> int:
    """How a session's episode ended: the agent finished (DONE), ran out of time, or failed (ENV_ERROR: marked
    like a reward error)."""
    if status == reward_pb2.SCORE_STATUS_TIMEOUT:
        return episode_pb2.EPISODE_END_TIMEOUT
    if status == reward_pb2.SCORE_STATUS_ERROR:
        return episode_pb2.EPISODE_END_ENV_ERROR
    return episode_pb2.EPISODE_END_DONE


def _tool_results(call: Call) -> int:
    """Tool results the agent sent back in this call's conversation (each answers one tool call)."""
    return sum(1 for m in call.messages if m.get("role") == "tool")
