"""Held-out evaluation inside a run (``trainer.eval``), on the trainer's rank 0, beside training.

After every ``every_steps``-th optimizer step (and after the last) rank 0 starts an evaluation task on its event
loop: the held-out rows go through the run's inference (Generate, the same port as rollout's) and reward services
(``relayrl.client.evaluation``, the code of ``relayrl eval``), and one :class:`~relayrl.common.metrics_row.EvalRow`
goes to ``metrics.jsonl`` and the tracker, whose backends log it under ``eval/``. Training never waits: one
evaluation runs at a time and one due meanwhile is skipped (``skipped`` counts them), except the last, which the
end of the run waits for. Its figures are of whatever inference serves while it runs: the row carries the weight
version published at its step and the oldest/newest version of any greedy token.

An evaluation that fails (a service unreachable, a deadline) is logged and counted in ``failed``; training goes on.
Rank 0 only, no collective: the other ranks never know about it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from relayrl.client import RewardClient
from relayrl.client.evaluation import EvalSettings, evaluate
from relayrl.client.inference_pool import connect_inference
from relayrl.common.dataset import Prompt, eval_prompts
from relayrl.common.metrics_row import EvalRow
from relayrl.config import RunConfig

log = logging.getLogger(__name__)


class InRunEval:
    def __init__(self, cfg: RunConfig, write: Callable[[EvalRow, int], None], t0: float | None = None) -> None:
        ec = cfg.trainer.eval
        self.cfg = cfg
        self.every = ec.every_steps
        self.write = write
        self.settings = EvalSettings(
            k=ec.k,
            samples=ec.samples,
            correct_threshold=ec.correct_threshold,
            concurrency=ec.concurrency,
            limit=ec.limit,
        )
        rows = eval_prompts(cfg.rollout, ec.dataset, "trainer.eval.dataset")
        self.rows: list[Prompt] = rows[: ec.limit] if ec.limit else list(rows)
        self.t0 = time.monotonic() if t0 is None else t0
        self.task: asyncio.Task[None] | None = None
        self.last_step = -1  # the step of the last evaluation started
        self.done = self.skipped = self.failed = 0

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def after_step(self, step: int, version: int, last: bool = False) -> None:
        """Start an evaluation when one is due after ``step`` (which published ``version``) and none runs; the
        last step's is left to :meth:`finish`, once its publication has landed."""
        if last or step % self.every:
            return
        if self.running:
            self.skipped += 1
            log.info("evaluation due after step %d skipped: the one after step %d still runs", step, self.last_step)
            return
        self._start(step, version)

    async def finish(self, step: int, version: int) -> None:
        """The end of the run (after the final checkpoint, every push settled): wait for the running evaluation,
        then evaluate the final weights unless that step was evaluated already."""
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
        if self.last_step != step:
            self._start(step, version)
            assert self.task is not None
            await asyncio.gather(self.task, return_exceptions=True)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def _start(self, step: int, version: int) -> None:
        self.last_step = step
        self.task = asyncio.create_task(self._run(step, version), name=f"eval-step-{step}")

    async def _run(self, step: int, version: int) -> None:
        try:
            result = await self._evaluate()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an evaluation is an observation: its failure never stops training
            self.failed += 1
            log.warning("evaluation after step %d failed: %s: %s", step, type(exc).__name__, exc)
            return
        self.done += 1
        row = self.row(step, version, result)
        self.write(row, step)
        log.info(
            "evaluation after step %d (version %d): greedy accuracy %.3f over %d rows in %.1fs",
            step,
            version,
            row.greedy_accuracy,
            row.rows,
            row.seconds,
        )

    async def _evaluate(self) -> dict[str, Any]:
        cfg = self.cfg
        async with (
            connect_inference([e.address for e in cfg.inference.replica_endpoints()], cfg.tls) as inference,
            RewardClient(
                cfg.reward.server.target,
                token=cfg.control.effective_code_token(),  # a code reward's
                tls=cfg.tls,
            ) as reward,
        ):
            return await evaluate(cfg, self.settings, self.rows, inference, reward)

    def row(self, step: int, version: int, result: dict[str, Any]) -> EvalRow:
        k = self.settings.k
        return EvalRow(
            eval_step=step,
            weight_version=version,
            weight_version_min=int(result.get("weight_version_min", 0)),
            weight_version_max=int(result.get("weight_version_max", 0)),
            greedy_accuracy=float(result["greedy_accuracy"]),
            mean_reward=float(result["mean_reward"]),
            sampled_mean_reward=float(result.get("sampled_mean_reward", 0.0)),
            pass_at_k=float(result.get(f"pass@{k}", 0.0)) if k else 0.0,
            k=k,
            rows=int(result["rows"]),
            reward_errors=int(result["reward_errors"]),
            seconds=float(result["seconds"]),
            skipped=self.skipped,
            time_s=time.monotonic() - self.t0,
        )
