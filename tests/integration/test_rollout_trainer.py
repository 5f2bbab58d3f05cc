"""rollout -> Redis -> trainer with every part real: gRPC services on port 0 and a redis-server."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.pb import inference_pb2_grpc, reward_pb2_grpc, trainer_pb2_grpc
from relayrl.common.stream import EpisodeStream
from relayrl.config import load_run_config
from relayrl.rollout.dataset import PromptCursor, load_jsonl
from relayrl.rollout.worker import RolloutWorker
from relayrl.tasks.arithmetic import reward
from relayrl.trainer.service import TrainerService, create_trainer_server
from tests.conftest import RedisServer
from tests.integration.helpers import inference_server, reward_server

pytestmark = pytest.mark.integration

REQUIRED_METRICS = {"step", "weight_version", "reward_mean", "episodes", "tokens", "staleness_mean",
                    "staleness_max", "time_s"}


@pytest.mark.parametrize(("max_staleness", "sft_steps"), [(0, 0), (1, 0), (1, 2)])
def test_episodes_flow_to_the_trainer_and_every_produced_episode_is_accounted_for(
        tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer,
        max_staleness: int, sft_steps: int) -> None:
    steps, groups, group_size = 4, 2, 4
    cfg = load_run_config(None, [
        f"model.path={tiny_model_dir}", f"rollout.dataset={dataset_path}", f"redis.url={redis_server.url}",
        f"output_dir={tmp_path / 'run'}", f"trainer.total_steps={steps}", f"trainer.groups_per_step={groups}",
        f"rollout.group_size={group_size}", f"rollout.max_staleness={max_staleness}", "rollout.max_new_tokens=3",
        "trainer.server.port=0", "trainer.checkpoint_every=2", "trainer.linger_s=0",
        f"trainer.sft_warmup_steps={sft_steps}", "trainer.sft_batch_size=8",
    ])

    async def go() -> dict[str, int]:
        async with inference_server(tiny_model_dir) as (inf_target, inf), reward_server(reward) as (rew_target, _):
            trainer = TrainerService(cfg)
            handle = create_trainer_server(trainer)
            await handle.start()
            stream = EpisodeStream.from_url(cfg.redis.url, cfg.redis.stream, cfg.redis.group)
            async with insecure_channel(inf_target) as a, insecure_channel(rew_target) as b, \
                    insecure_channel(f"127.0.0.1:{handle.port}") as c:
                worker = RolloutWorker(cfg.rollout, stream, PromptCursor(load_jsonl(dataset_path), True, 0),
                                       inference_pb2_grpc.InferenceServiceStub(a), reward_pb2_grpc.RewardServiceStub(b),
                                       trainer_pb2_grpc.TrainerServiceStub(c))
                inference = replace(cfg.inference, server=replace(cfg.inference.server, address=inf_target))
                trainer.cfg = replace(cfg, inference=inference)  # where the trainer pushes weights
                stop = asyncio.Event()
                rollout = asyncio.create_task(worker.run(stop))
                await asyncio.wait_for(trainer.train(), timeout=120)
                await asyncio.wait_for(rollout, timeout=30)  # rollout ends once the trainer says finished
            info = await stream.info()
            await handle.stop(0)
            await trainer.close()
            await stream.close()
            return {"produced": worker.episodes_produced, "trained": trainer.episodes_trained,
                    "dropped": trainer.collector.episodes_dropped_stale, "pending": info.pending + info.lag,
                    "length": info.length, "inference_version": inf.engine.version}

    counts = asyncio.run(go())

    all_rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["sft_step"] for r in all_rows if r.get("phase") == "sft"] == list(range(1, sft_steps + 1))
    rows = [r for r in all_rows if r.get("phase") != "sft"]
    first_version = 1 if sft_steps else 0  # the warm-up publishes one version before RL starts
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["weight_version"] for r in rows] == [first_version + i for i in (1, 2, 3, 4)]
    assert all(set(r) >= REQUIRED_METRICS for r in rows)
    assert all(r["episodes"] == groups * group_size for r in rows)
    assert all(r["staleness_max"] <= max_staleness for r in rows)
    assert counts["inference_version"] == first_version + 4
    assert counts["trained"] == steps * groups * group_size
    assert counts["produced"] == counts["length"]
    assert counts["produced"] == counts["trained"] + counts["dropped"] + counts["pending"]
    assert (tmp_path / "run" / "checkpoints" / "step_000004" / "model" / "config.json").is_file()
