"""A stop asked of one rank only, mid-step: both gloo ranks agree at the same micro-batch boundary and abandon the
step (real processes); and what the agreement costs per micro-batch."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relayrl.common.model import load_model
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import TrainerConfig
from relayrl.trainer import learner as learner_module
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner, StepAbandoned, stop_agreed
from tests.conftest import free_port
from tests.distributed.gloo import gloo_group
from tests.synthetic import varied_episodes

pytestmark = pytest.mark.distributed

STOP_AFTER = 2  # rank 1 is asked to stop during its third micro-batch (index 2)
TIMED_CALLS = 200


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    with gloo_group(rank, port):
        coll = Collectives(dist.group.WORLD, timeout_s=60)
        model = load_model(ModelConfig(path=Path(model_dir)))
        learner = Learner(
            model, TrainerConfig(micro_batch_size=1), 0, torch.device("cpu"), max_completion_tokens=8, collectives=coll
        )
        forward = learner_module.model_logprobs
        calls = [0]

        def counted(*args: Any) -> torch.Tensor:
            if rank == 1 and calls[0] == STOP_AFTER:
                learner.stop.set()  # the signal handler of rank 1 only, during a micro-batch
            calls[0] += 1
            return forward(*args)

        learner_module.model_logprobs = counted  # type: ignore[assignment]
        result: dict[str, Any] = {}
        try:
            learner.rl_step(StepBatch.of(varied_episodes()[:6] if rank == 0 else varied_episodes()[6:]))
        except StepAbandoned as stopped:
            result.update(done=stopped.done, total=stopped.total)
        result["grads"] = sum(p.grad is not None for p in model.parameters())
        result["steps_done"] = learner.steps_done
        t0 = time.perf_counter()
        for _ in range(TIMED_CALLS):
            stop_agreed(coll, False)
        result["agreement_us"] = (time.perf_counter() - t0) / TIMED_CALLS * 1e6
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def test_a_stop_asked_of_one_rank_mid_step_is_agreed_by_both_at_the_same_boundary(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    mp.start_processes(
        _rank_main, args=(free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2, start_method="spawn", join=True
    )

    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # rank 1 set its flag during micro-batch 2: both ranks stop at the boundary after it, with 3 of 6 done
    assert [(r["done"], r["total"]) for r in results] == [(STOP_AFTER + 1, 6)] * 2
    assert [(r["grads"], r["steps_done"]) for r in results] == [(0, 0)] * 2  # nothing of the step applied
    for r in results:  # the agreement's cost, per micro-batch (gloo, one int64), for the report
        print(f"stop agreement: {r['agreement_us']:.0f} us per micro-batch boundary")


if __name__ == "__main__":  # spawn re-imports this module
    sys.exit(0)
