"""``relayrl eval``: score a model on a held-out dataset through the inference and reward services.

The figures and how each row is scored are relayrl.client.evaluation's (shared with the evaluation inside a run).
Works on any model and task: the dataset and verifier come from the run config. A multi-turn run (rollout.workflow
other than single_turn) plays whole episodes of its workflow per row (greedy: ``top_k = 1``; :func:`player`).

Without ``--inference``/``--reward`` addresses the command serves the model itself: inference and reward start in
this process on free loopback ports (the same service code as a run) and stop at the end. A LoRA checkpoint is
merged into its base first (``relayrl merge-lora``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from relayrl.client import InferenceClient, RewardClient
from relayrl.client.evaluation import EvalSettings, RowPlayer, evaluate, pass_at_k
from relayrl.client.inference_pool import Inference, connect_inference
from relayrl.common.dataset import Prompt, eval_prompts
from relayrl.common.episodes import end_name, reward_failed
from relayrl.config import RunConfig
from relayrl.config.typed import ConfigError

__all__ = ["EvalSettings", "evaluate", "pass_at_k", "run_eval"]

log = logging.getLogger(__name__)


async def _workflow_row(
    cfg: RunConfig, s: EvalSettings, row: Prompt, inference: Inference, reward: RewardClient
) -> dict[str, Any]:
    """A row of a multi-turn run: whole episodes of the configured workflow (greedy, then sampled), scored as in
    training, with their turns, tool calls and how they ended."""
    from relayrl.rollout.workflows.api import WorkflowContext
    from relayrl.rollout.workflows.loader import build_workflow

    rc = cfg.rollout
    workflow, environment = build_workflow(rc, cfg.model.path, reward=reward)  # tools' code runs: reward's RunCode

    async def play(settings: Any, n: int) -> list[Any]:
        ctx = WorkflowContext(
            inference=inference,
            reward=reward,
            group_id=uuid.uuid4().hex,
            group_size=n,
            producer_id="eval",
            created_at=time.time(),
            config=settings,
            environment=environment,
        )
        return list(await workflow(row, ctx))

    try:
        episodes = await play(replace(rc, top_k=1, temperature=1.0), 1)
        n = s.samples or s.k
        if n:
            episodes += await play(rc, n)
    finally:
        close = getattr(workflow, "close", None)
        if close is not None:
            await close()
    ok = [not reward_failed(e) for e in episodes]
    correct = [good and e.reward >= s.correct_threshold for e, good in zip(episodes, ok, strict=True)]
    versions = list(episodes[0].token_weight_versions)
    return {
        "id": row.prompt_id,
        "answer": row.answer,
        "greedy": episodes[0].completion_text,
        "greedy_reward": episodes[0].reward,
        "greedy_correct": correct[0],
        "versions": (min(versions), max(versions)) if versions else None,
        "sampled_rewards": [e.reward for e in episodes[1:]],
        "sampled_correct": sum(correct[1:]),
        "reward_errors": sum(not good for good in ok),
        "turns": [max(e.turns, 1) for e in episodes],
        "tool_calls": sum(e.tool_calls for e in episodes),
        "tool_errors": sum(e.tool_errors for e in episodes),
        "episode_ends": [end_name(e.episode_end) for e in episodes],
    }


def player(cfg: RunConfig) -> RowPlayer | None:
    """How ``relayrl eval`` plays a row of this run: whole workflow episodes for a multi-turn run, else the default
    single-turn generation."""
    return _workflow_row if cfg.rollout.multi_turn else None


def _servable(model: Path, cfg: RunConfig, tmp: Path) -> Path:
    """The HF directory to serve: a model dir as is, a checkpoint's model folder, or a LoRA adapter merged into
    ``model.path`` (served without peft; a fresh adapter is the identity, so no LoRA is served)."""
    from relayrl.common.lora import is_adapter_dir, merge_adapter

    inner = model / "model" if (model / "model").is_dir() else model
    if is_adapter_dir(inner):
        return merge_adapter(inner, cfg.model.path, tmp / "merged")
    if not (inner / "config.json").is_file():
        raise ConfigError("model", str(model), "must be a Hugging Face model directory or a checkpoint")
    return inner


async def _serve_and_evaluate(cfg: RunConfig, s: EvalSettings, rows: list[Prompt], model: Path) -> dict[str, Any]:
    """Start inference (serving ``model``) and reward in this process on free loopback ports, evaluate, stop."""
    import os

    from relayrl.common.grpc_utils import check_health
    from relayrl.inference.main import serve as serve_inference
    from relayrl.launcher import local
    from relayrl.local_redis import free_ports
    from relayrl.reward.main import serve as serve_reward

    os.environ.setdefault(cfg.control.weights_token_env, secrets.token_urlsafe(32))  # nobody pushes weights here
    os.environ.setdefault(cfg.control.code_token_env, secrets.token_urlsafe(32))  # RunCode for this eval's tools
    with tempfile.TemporaryDirectory(prefix="relayrl-eval-") as tmp:
        path = await asyncio.to_thread(_servable, model, cfg, Path(tmp))
        ports = free_ports(3)
        ic, rw = cfg.inference, cfg.reward
        served = replace(
            cfg,
            output_dir=Path(tmp),
            model=replace(cfg.model, path=path, lora=replace(cfg.model.lora, enabled=False)),
            inference=replace(
                ic,
                server=local(ic.server, ports[0]),
                weights_server=local(ic.weights_server, ports[1]),
                http=replace(ic.http, enabled=False),
            ),
            reward=replace(rw, server=local(rw.server, ports[2]), http=replace(rw.http, enabled=False)),
        )
        stop = asyncio.Event()
        tasks = [asyncio.create_task(serve_inference(served, stop)), asyncio.create_task(serve_reward(served, stop))]
        try:
            for target in (served.inference.server.target, served.reward.server.target):
                while not await asyncio.to_thread(check_health, target, 1.0, "", served.tls):
                    for t in tasks:
                        if t.done():
                            t.result()  # a service that failed to start: its error
                            raise RuntimeError("a service stopped during start-up")
                    await asyncio.sleep(0.2)
            async with (
                InferenceClient(served.inference.server.target, tls=served.tls) as inference,
                RewardClient(
                    served.reward.server.target, token=cfg.control.effective_code_token(), tls=served.tls
                ) as reward,
            ):
                result = await evaluate(served, s, rows, inference, reward, player(served))
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"model": str(model), **result}


def run_eval(
    cfg: RunConfig,
    s: EvalSettings,
    dataset: Path | None,
    model: Path | None = None,
    inference: str = "",
    reward: str = "",
) -> dict[str, Any]:
    """Evaluate ``model`` (default ``model.path``) on ``dataset`` (default: the rows rollout.held_out_rows holds out
    of the training dataset), through the services at ``inference`` and ``reward`` (host:port) when given, else
    through ones this call serves."""
    held = eval_prompts(cfg.rollout, dataset, "dataset")
    rows = held[: s.limit] if s.limit else list(held)
    if bool(inference) != bool(reward):
        raise ConfigError("inference", inference or "''", "give both --inference and --reward, or neither")

    async def against(inference_target: str, reward_target: str) -> dict[str, Any]:
        async with (
            connect_inference(inference_target.split(","), cfg.tls) as inf,  # a replica, or several: a pool
            RewardClient(reward_target, token=cfg.control.effective_code_token(), tls=cfg.tls) as rew,
        ):
            return await evaluate(cfg, s, rows, inf, rew, player(cfg))

    if inference:
        result = asyncio.run(against(inference, reward))
    else:
        result = asyncio.run(_serve_and_evaluate(cfg, s, rows, (model or cfg.model.path).resolve()))
    return {"dataset": str(dataset) if dataset else f"{cfg.rollout.dataset} (held-out rows)", **result}
