"""Held-out evaluation through the inference and reward services: the figures of ``relayrl eval`` and of the
evaluation inside a run (``trainer.eval``).

For each row: one greedy sample (``top_k = 1``) and, with ``k`` > 0, ``samples`` sampled completions at the run's
rollout sampling settings; each completion is scored by the reward service exactly as in training (the row's answer
as reference, its other keys as metadata). A completion is correct when its score is OK and at least
``correct_threshold``; a score that failed (error, timeout) counts as wrong and is reported in ``reward_errors``.

Figures: ``greedy_accuracy``, ``mean_reward`` (greedy), ``sampled_mean_reward``, and ``pass@k`` with the unbiased
estimator of Chen et al. (2021): the mean over rows of 1 - C(n - c, k) / C(n, k) for n samples of which c are
correct. ``weight_version_min``/``max``: the oldest and newest weight version of any greedy token (inference may
swap weights during an evaluation that runs beside training).

A multi-turn run plays whole episodes of its workflow per row instead (``play``: relayrl.evaluation supplies it for
``relayrl eval``), and adds ``turns_mean``, ``tool_calls_mean``, ``tool_errors`` and ``episode_ends`` (how the
episodes ended) to the figures.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from relayrl.client.inference_pool import Inference
from relayrl.client.reward import RewardClient
from relayrl.common.dataset import Prompt
from relayrl.common.episodes import reward_of, score_ok
from relayrl.common.pb import inference_pb2, reward_pb2
from relayrl.common.reward_metadata import encode_metadata
from relayrl.config import RunConfig
from relayrl.config.typed import ConfigError


@dataclass(frozen=True)
class EvalSettings:
    k: int = 0  # pass@k (0: greedy only)
    samples: int = 0  # sampled completions per row (0: k)
    correct_threshold: float = 1.0
    concurrency: int = 8  # rows evaluated at once
    limit: int = 0  # first rows only (0: all)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for n samples of which c are correct (k <= n)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


async def _score(reward: RewardClient, row: Prompt, texts: list[str], timeout_s: float) -> list[tuple[float, bool]]:
    """(score, ok) per completion."""
    meta = encode_metadata(row.metadata)
    resp = await reward.score_batch(
        [
            reward_pb2.ScoreRequest(
                episode_id=uuid.uuid4().hex, prompt=row.prompt, completion=t, reference=row.answer, metadata=meta
            )
            for t in texts
        ],
        timeout_s=timeout_s,
    )
    return [(reward_of(r), score_ok(r.status)) for r in resp.responses]


async def _row(
    cfg: RunConfig, s: EvalSettings, row: Prompt, inference: Inference, reward: RewardClient
) -> dict[str, Any]:
    rc = cfg.rollout
    prompt: Any = row.chat() or row.prompt
    greedy = await inference.generate(
        prompt,
        inference_pb2.SamplingParams(n=1, temperature=1.0, top_k=1, max_new_tokens=rc.max_new_tokens, stop=rc.stop),
        timeout_s=rc.generate_timeout_s,
    )
    texts = [greedy.samples[0].text]
    n = s.samples or s.k
    if n:
        sampled = await inference.generate(
            prompt,
            inference_pb2.SamplingParams(
                n=n,
                temperature=rc.temperature,
                top_p=rc.top_p,
                top_k=rc.top_k,
                max_new_tokens=rc.max_new_tokens,
                stop=rc.stop,
            ),
            timeout_s=rc.generate_timeout_s,
        )
        texts += [x.text for x in sampled.samples]
    scores = await _score(reward, row, texts, rc.score_timeout_s)
    correct = [ok and score >= s.correct_threshold for score, ok in scores]
    versions = list(greedy.samples[0].weight_versions)
    return {
        "id": row.prompt_id,
        "answer": row.answer,
        "greedy": texts[0],
        "greedy_reward": scores[0][0],
        "versions": (min(versions), max(versions)) if versions else None,
        "greedy_correct": correct[0],
        "sampled_rewards": [x for x, _ in scores[1:]],
        "sampled_correct": sum(correct[1:]),
        "reward_errors": sum(not ok for _, ok in scores),
    }


# One row's outcome: (run config, settings, row, inference, reward) -> the row's dict (see _row)
RowPlayer = Callable[[RunConfig, EvalSettings, Prompt, Inference, RewardClient], Awaitable[dict[str, Any]]]


def multi_turn_figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Turns and tool calls per episode, failed tool calls and how the episodes ended (rows of multi-turn runs)."""
    episodes = sum(len(r["turns"]) for r in results)
    ends: dict[str, int] = {}
    for r in results:
        for end in r["episode_ends"]:
            ends[end] = ends.get(end, 0) + 1
    return {
        "turns_mean": sum(sum(r["turns"]) for r in results) / episodes,
        "tool_calls_mean": sum(r["tool_calls"] for r in results) / episodes,
        "tool_errors": sum(r["tool_errors"] for r in results),
        "episode_ends": ends,
    }


async def evaluate(
    cfg: RunConfig,
    s: EvalSettings,
    rows: list[Prompt],
    inference: Inference,
    reward: RewardClient,
    play: RowPlayer | None = None,
) -> dict[str, Any]:
    """Score ``rows`` through running services (each with ``play``, by default one single-turn generation); the
    figures and every row's outcome."""
    n = s.samples or s.k
    if s.k and n < s.k:
        raise ConfigError("samples", n, f"must be >= k ({s.k})")
    gate = asyncio.Semaphore(s.concurrency)
    t0 = time.perf_counter()

    async def one(row: Prompt) -> dict[str, Any]:
        async with gate:
            return await (play or _row)(cfg, s, row, inference, reward)

    results = await asyncio.gather(*(one(r) for r in rows))
    status = await inference.status()
    out: dict[str, Any] = {
        "rows": len(results),
        "weight_version": status.weight_version,
        "model_path": status.model_path,
        "greedy_accuracy": sum(r["greedy_correct"] for r in results) / len(results),
        "mean_reward": sum(r["greedy_reward"] for r in results) / len(results),
        "reward_errors": sum(r["reward_errors"] for r in results),
        "correct_threshold": s.correct_threshold,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    spans = [r.pop("versions") for r in results]
    seen = [v for v in spans if v is not None]
    if seen:
        out["weight_version_min"], out["weight_version_max"] = min(v[0] for v in seen), max(v[1] for v in seen)
    if results and "turns" in results[0]:
        out |= multi_turn_figures(results)
    if n:
        out["samples_per_prompt"] = n
        out["temperature"] = cfg.rollout.temperature
        out["sampled_mean_reward"] = sum(sum(r["sampled_rewards"]) for r in results) / (n * len(results))
        if s.k:
            out[f"pass@{s.k}"] = sum(pass_at_k(n, r["sampled_correct"], s.k) for r in results) / len(results)
    out["per_row"] = results
    return out
