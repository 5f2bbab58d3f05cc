"""Evaluation inside a run (trainer.eval): every N steps, beside training, logged as eval rows and under eval/."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relayrl.common.metrics_row import EvalRow, parse_row
from relayrl.config import load_run_config
from relayrl.config.typed import ConfigError
from relayrl.trainer.in_run_eval import InRunEval
from tests.conftest import RedisServer
from tests.integration.stack import run_stack, stack_config

pytestmark = pytest.mark.integration


async def test_eval_every_two_steps_logs_eval_rows_and_tracker_scalars_under_eval(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    # the user's own layout: a Parquet file whose fields are called question and solution; the evaluation scores
    # the rows the loader holds out of it
    source = [json.loads(line) for line in dataset_path.read_text().splitlines() if line.strip()]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": r["prompt"], "solution": r["answer"]} for r in source]), data)
    cfg = stack_config(
        tmp_path / "run",
        tiny_model_dir,
        data,
        redis_server.url,
        "rollout.fields.prompt=question",
        "rollout.fields.answer=solution",
        "rollout.held_out_rows=6",
        "trainer.eval.every_steps=2",
        "trainer.eval.limit=4",
        "trainer.eval.k=2",
    )

    out = await run_stack(cfg, tiny_model_dir)

    lines = [json.loads(line) for line in cfg.metrics_path.read_text().splitlines()]
    evals = [parse_row(r) for r in lines if r.get("phase") == "eval"]
    versions = {r["step"]: r["weight_version"] for r in lines if "phase" not in r}
    assert all(isinstance(r, EvalRow) for r in evals)
    rows: list[EvalRow] = evals  # type: ignore[assignment]
    # step 2 starts one in the background; the last step's runs once its publication landed (the run waits for it)
    assert [r.eval_step for r in rows] == [2, 4]
    assert all(r.rows == 4 and r.k == 2 and r.reward_errors == 0 and 0 <= r.greedy_accuracy <= 1 for r in rows)
    assert [r.weight_version for r in rows] == [versions[2], versions[4]]
    assert all(1 <= r.weight_version_min <= r.weight_version_max <= versions[4] for r in rows)
    assert rows[-1].weight_version_min == versions[4]  # after the last step nothing else is published
    assert all(parse_row(r.to_json()) == r for r in rows)
    tb = out["tensorboard"]  # the tracker's TensorBoard backend: the eval rows under eval/, the step as x-axis
    assert [s for s, _ in tb["eval/greedy_accuracy"]] == [2, 4]
    assert [v for _, v in tb["eval/pass_at_k"]] == pytest.approx([r.pass_at_k for r in rows])
    assert out["produced"] == out["trained"] + out["dropped"] + out["invalid"] + out["pending"]


def _eval(tmp_path: Path, data: Path) -> tuple[InRunEval, list[EvalRow]]:
    cfg = load_run_config(
        None, [f"output_dir={tmp_path}", "trainer.eval.every_steps=2", f"trainer.eval.dataset={data}"]
    )
    written: list[EvalRow] = []
    return InRunEval(cfg, lambda row, step: written.append(row)), written


async def test_an_eval_due_while_one_runs_is_skipped_and_training_never_waits(
    tmp_path: Path, dataset_path: Path
) -> None:
    async def scenario() -> tuple[list[EvalRow], int, bool]:
        ev, written = _eval(tmp_path, dataset_path)
        release, calls = asyncio.Event(), []

        async def held() -> dict[str, Any]:
            calls.append(1)
            await release.wait()
            return {"rows": 3, "greedy_accuracy": 1 / 3, "mean_reward": 0.5, "reward_errors": 0, "seconds": 0.1}

        ev._evaluate = held  # type: ignore[method-assign]
        ev.after_step(1, 11)  # not due
        ev.after_step(2, 12)  # starts; returns at once
        await asyncio.sleep(0)  # the task runs up to its wait
        ev.after_step(4, 14)  # due while the first runs: skipped
        ev.after_step(5, 15, last=True)  # the last step's waits for finish()
        running = ev.running
        release.set()
        await ev.finish(5, 15)  # the last step: waits for the running one, then evaluates step 5
        return written, len(calls), running

    written, calls, running = await scenario()

    assert running and calls == 2
    assert [(r.eval_step, r.weight_version, r.skipped) for r in written] == [(2, 12, 1), (5, 15, 1)]
    assert written[0].greedy_accuracy == pytest.approx(1 / 3)


async def test_a_failed_eval_is_counted_and_raises_nothing(tmp_path: Path, dataset_path: Path) -> None:
    async def scenario() -> InRunEval:
        ev, _ = _eval(tmp_path, dataset_path)

        async def unreachable() -> dict[str, Any]:
            raise ConnectionError("inference is gone")

        ev._evaluate = unreachable  # type: ignore[method-assign]
        ev.after_step(2, 3)
        await ev.finish(2, 3)  # step 2 already evaluated (and failed): nothing more
        return ev

    ev = await scenario()

    assert (ev.failed, ev.done) == (1, 0)


def test_eval_every_steps_without_a_dataset_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.eval\.dataset"):
        load_run_config(None, [f"output_dir={tmp_path}", "trainer.eval.every_steps=5"])
