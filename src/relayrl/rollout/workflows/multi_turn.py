"""The built-in multi-turn workflow: each episode of a group plays its own environment, turn by turn, token in and
token out (see trajectory.py), within the per-episode limits of the rollout config.

Per turn: Generate with the exact ids so far as ``prompt_token_ids`` and the new observation as ``suffix_text``
(the first turn sends the environment's first observation as text or a conversation), append the sampled ids
(loss mask 1), then ``env.step`` on the sampled text. The episode ends when the environment says done or truncated,
or at a limit: ``max_turns``, ``max_episode_tokens`` (model and observation tokens), ``episode_timeout_s``,
``max_tool_calls``; ``Episode.episode_end`` says which. An exception from ``step`` ends the episode marked as an
environment error (excluded from the loss and counted by the trainer, like a reward error); one from ``reset``
leaves no episode to mark, so it fails the group (retried, then skipped and counted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import replace

from relayrl.client.inference_pool import pinned
from relayrl.common.dataset import Prompt
from relayrl.common.pb import episode_pb2, inference_pb2, reward_pb2
from relayrl.rollout.workflows.api import Environment, EnvironmentFactory, GroupFailed, StepResult, WorkflowContext
from relayrl.rollout.workflows.trajectory import EpisodeEnd, Trajectory, episode_from, score_metadata

log = logging.getLogger(__name__)

_LIMIT_ENDS = {
    "max_tool_calls": EpisodeEnd.EPISODE_END_MAX_TOOL_CALLS,
    "max_turns": EpisodeEnd.EPISODE_END_MAX_TURNS,
    "max_tokens": EpisodeEnd.EPISODE_END_MAX_TOKENS,
}


class MultiTurnWorkflow:
    """``environment`` builds each episode's environment (default: the context's). ``score``: the final answer
    (the last model turn's text, less its tool calls) is scored by the reward service, which then gives the
    episode's reward; otherwise the reward is the sum of the environment's step rewards. ``stop``: stop strings
    beside rollout.stop (a tool call's closing tag, so the tool runs as soon as the call is written)."""

    def __init__(
        self,
        environment: EnvironmentFactory | None = None,
        score: bool = False,
        stop: Sequence[str] = (),
        answer: object = None,
    ) -> None:
        self.environment = environment
        self.score = score
        self.stop = list(stop)
        self.answer = answer  # callable(text) -> the final answer to score (default: the text itself)

    async def __call__(self, row: Prompt, ctx: WorkflowContext) -> list[episode_pb2.Episode]:
        factory = self.environment or ctx.environment
        if factory is None:
            raise GroupFailed("the multi_turn workflow has no environment (rollout.environment)")
        trajs = await asyncio.gather(*(self.run_episode(factory(row), row, ctx, i) for i in range(ctx.group_size)))
        ids = [uuid.uuid4().hex for _ in trajs]
        scores: list[reward_pb2.ScoreResponse | None] = [None] * len(trajs)
        if self.score:
            scores = await self._score(row, ctx, ids, trajs)
        return [
            episode_from(t, row, ctx, i, eid, s) for i, (t, eid, s) in enumerate(zip(trajs, ids, scores, strict=True))
        ]

    async def _score(
        self, row: Prompt, ctx: WorkflowContext, ids: list[str], trajs: list[Trajectory]
    ) -> list[reward_pb2.ScoreResponse | None]:
        todo = [i for i, t in enumerate(trajs) if t.end != EpisodeEnd.EPISODE_END_ENV_ERROR]
        if not todo:
            return [None] * len(trajs)
        answer = self.answer if callable(self.answer) else (lambda text: text)
        got = await ctx.reward.score_batch(
            [
                reward_pb2.ScoreRequest(
                    episode_id=ids[i],
                    prompt=row.prompt,
                    completion=answer(trajs[i].last_text),
                    reference=row.answer,
                    metadata=score_metadata(row, trajs[i]),
                )
                for i in todo
            ],
            timeout_s=ctx.config.score_timeout_s,
        )
        if len(got.responses) != len(todo):
            raise GroupFailed(f"reward returned {len(got.responses)} scores for {len(todo)} episodes")
        out: list[reward_pb2.ScoreResponse | None] = [None] * len(trajs)
        for i, r in zip(todo, got.responses, strict=True):
            out[i] = r
        return out

    async def run_episode(self, env: Environment, row: Prompt, ctx: WorkflowContext, index: int) -> Trajectory:
        """Play one episode to its end; ``env`` is closed whatever happens. Its turns stay on one inference replica
        (the one that holds its prefix) while that replica serves."""
        ctx = replace(ctx, inference=pinned(ctx.inference))
        traj = Trajectory()
        try:
            try:
                first = await env.reset(row, index)
            except Exception as exc:  # no token yet: nothing to mark, the group fails (counted, retried)
                raise GroupFailed(f"environment reset failed: {type(exc).__name__}: {exc}") from exc
            try:
                async with asyncio.timeout(ctx.config.episode_timeout_s):
                    await self._play(env, first, row, ctx, index, traj)
            except TimeoutError:
                traj.end = EpisodeEnd.EPISODE_END_TIMEOUT
        finally:
            try:
                await env.close()
            except Exception:
                log.exception("closing the environment of prompt %s failed", row.prompt_id)
        if 1 not in traj.mask:
            raise GroupFailed(
                f"an episode of prompt {row.prompt_id} ended ({EpisodeEnd.Name(traj.end)}) before the "
                "model wrote a token"
            )
        return traj

    def _sampling(self, ctx: WorkflowContext, max_new_tokens: int) -> inference_pb2.SamplingParams:
        cfg = ctx.config
        return inference_pb2.SamplingParams(
            n=1,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_new_tokens=max_new_tokens,
            stop=[*cfg.stop, *self.stop],
        )

    async def _turn(
        self, first: str | list[dict[str, str]], obs: str, ctx: WorkflowContext, index: int, traj: Trajectory, want: int
    ) -> inference_pb2.Sample | None:
        """Sample one turn after the observation ``obs``; None when the observation leaves no room."""
        cfg, rid = ctx.config, f"{ctx.group_id}-{index}-{traj.turns}"
        if traj.turns == 0:
            gen = await ctx.inference.generate(
                first, self._sampling(ctx, want), timeout_s=cfg.generate_timeout_s, request_id=rid
            )
            traj.prompt_ids = list(gen.prompt_token_ids)
            traj.prompt_text = first if isinstance(first, str) else json.dumps(first, ensure_ascii=False)
        else:
            context = traj.context()
            gen = await ctx.inference.generate(
                context, self._sampling(ctx, want), timeout_s=cfg.generate_timeout_s, request_id=rid, suffix_text=obs
            )
            if list(gen.prompt_token_ids[: len(context)]) != context:
                raise GroupFailed("inference changed the ids of earlier turns (token-in/token-out broken)")
            obs_ids = list(gen.prompt_token_ids[len(context) :])
            room = cfg.max_episode_tokens - len(traj.ids)
            if len(obs_ids) >= room:  # the observation fills the episode: keep what fits, end here
                traj.add_observation(obs_ids[:room], obs)
                return None
            traj.add_observation(obs_ids, obs)
        if len(gen.samples) != 1:
            raise GroupFailed(f"inference returned {len(gen.samples)} samples, expected 1")
        sample: inference_pb2.Sample = gen.samples[0]
        traj.add_model_turn(sample, cfg.max_episode_tokens - len(traj.ids))
        return sample

    async def _play(
        self,
        env: Environment,
        first: str | list[dict[str, str]],
        row: Prompt,
        ctx: WorkflowContext,
        index: int,
        traj: Trajectory,
    ) -> None:
        cfg, obs = ctx.config, ""
        while True:
            # an observation of b bytes is at most b tokens (no special tokens are added to it)
            want = min(cfg.max_new_tokens, cfg.max_episode_tokens - len(traj.ids) - len(obs.encode()))
            sample = await self._turn(first, obs, ctx, index, traj, want) if want >= 1 else None
            if sample is None:
                traj.end = EpisodeEnd.EPISODE_END_MAX_TOKENS
                return
            try:
                result: StepResult = await env.step(sample.text)
            except Exception as exc:  # marked and counted, never scored 0
                log.warning("environment step failed for prompt %s: %s: %s", row.prompt_id, type(exc).__name__, exc)
                traj.end, traj.error = EpisodeEnd.EPISODE_END_ENV_ERROR, f"environment: {type(exc).__name__}: {exc}"
                return
            traj.reward += result.reward
            traj.tool_calls += result.tool_calls
            traj.tool_errors += result.tool_errors
            end = self._end(result, traj, cfg.max_turns, cfg.max_episode_tokens)
            if end is not None:
                traj.end = end
                return
            obs = result.observation

    @staticmethod
    def _end(result: StepResult, traj: Trajectory, max_turns: int, max_tokens: int) -> int | None:
        if result.done:
            return EpisodeEnd.EPISODE_END_DONE
        if result.truncated:
            return _LIMIT_ENDS.get(result.limit, EpisodeEnd.EPISODE_END_TRUNCATED)
        if traj.turns >= max_turns:
            return EpisodeEnd.EPISODE_END_MAX_TURNS
        if len(traj.ids) >= max_tokens:
            return EpisodeEnd.EPISODE_END_MAX_TOKENS
        return None
