"""FSDP2 in the trainer service: two gloo ranks with dp_shard=2 run the real Trainer (Redis stream, weight versions,
publication to a real inference server verified by its probe, checkpoints) and match two replicated ranks
(dp_replicate=2) on the same groups; a sharded run checkpointed at step 1 resumes from its DCP shards. The sharded
publications stream the gathered tensors through grpc_stream (chunks read from rank 0's spool file) and, overlapped
with training, through shared_memory (the spool file linked under the version's name); inference ends up serving
exactly the trained weights."""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import redis
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relayrl.common.model import load_model
from relayrl.common.pb.episode_pb2 import EpisodeGroup
from relayrl.common.redis_keys import STREAM_FIELD, RedisKeys
from relayrl.common.weights import model_tensors
from relayrl.config import RunConfig, load_run_config
from relayrl.config.model import ModelConfig
from tests.conftest import RedisServer, free_port
from tests.synthetic import varied_episodes

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

GROUPS_PER_STEP = 2


def _groups() -> list[EpisodeGroup]:
    """Four groups of three (two steps of two groups), valid for the tiny model (ids < its vocabulary)."""
    eps = varied_episodes(12)
    groups = []
    for g in range(4):
        members = eps[3 * g : 3 * g + 3]
        for i, ep in enumerate(members):
            ep.sample_index = i
        groups.append(EpisodeGroup(group_id=f"g{g}", episodes=members, prompt_seq=g))
    return groups


def _config(
    model_dir: str, out: str, redis_url: str, dp_shard: int, steps: int, resume: bool, transport: str
) -> RunConfig:
    return load_run_config(
        None,
        [
            f"model.path={model_dir}",
            f"redis.url={redis_url}",
            f"output_dir={out}",
            f"trainer.total_steps={steps}",
            f"trainer.groups_per_step={GROUPS_PER_STEP}",
            "rollout.group_size=3",
            "rollout.max_new_tokens=8",
            "rollout.max_staleness=8",
            "trainer.distributed.world_size=2",
            f"trainer.distributed.dp_shard={dp_shard}",
            "trainer.checkpoint.every=1",
            "trainer.linger_s=0",
            f"trainer.publication.transport={transport}",
            f"trainer.publication.overlap={str(transport == 'shared_memory').lower()}",
            "trainer.distributed.collective_timeout_s=60",
            *(["trainer.checkpoint.resume=auto"] if resume else []),
        ],
    )


async def _train(cfg: RunConfig, rank: int, model_dir: Path) -> None:
    from relayrl.trainer.collectives import Collectives
    from relayrl.trainer.runtime import Trainer
    from tests.integration.helpers import inference_server, with_services

    coll = Collectives(dist.group.WORLD, 60.0, group_name="world")
    if rank != 0:  # only rank 0 publishes
        trainer = Trainer(cfg, coll)
        try:
            await trainer.train()
        finally:
            await trainer.close()
        return
    async with inference_server(model_dir, weights_dir=cfg.weights_dir) as (target, inf):
        cfg = with_services(cfg, target, inf.weights_target)
        trainer = Trainer(cfg, coll)
        try:
            await trainer.train()
        finally:
            await trainer.close()
        assert inf.engine.version == trainer.publication.weight_version  # the probe-verified, gathered weights
        served = {k: v.detach().clone() for k, v in model_tensors(inf.engine.model).items()}  # type: ignore[attr-defined]
        torch.save(served, cfg.output_dir / f"served-{cfg.trainer.total_steps}.pt")


# (output folder, dp_shard, total steps, resume, fresh stream, transport): one pair of processes runs them in turn
# (spawning costs more than training here)
PHASES = [
    ("replicated", 1, 2, False, True, "grpc_stream"),
    ("sharded", 2, 1, False, True, "grpc_stream"),
    ("sharded", 2, 2, True, False, "shared_memory"),
]


def _rank_main(rank: int, port: int, model_dir: str, out: str, redis_url: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        for name, dp_shard, steps, resume, fresh, transport in PHASES:
            if fresh and rank == 0:
                _fresh_stream(redis_url)
            dist.barrier()
            cfg = _config(model_dir, str(Path(out) / name), redis_url, dp_shard, steps, resume, transport)
            asyncio.run(_train(cfg, rank, Path(model_dir)))
    finally:
        dist.destroy_process_group()


def _fresh_stream(url: str) -> None:
    client = redis.Redis.from_url(url)
    client.flushall()
    keys = RedisKeys()
    for g in _groups():
        client.xadd(keys.stream, {STREAM_FIELD: g.SerializeToString()})
    client.close()


def _weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    model = load_model(ModelConfig(path=out / "checkpoints" / f"step_{step:06d}" / "model"))
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_sharded_ranks_train_publish_and_resume_like_replicated_ranks(
    tmp_path: Path, tiny_model_dir: Path, redis_server: RedisServer
) -> None:
    mp.start_processes(
        _rank_main,
        args=(free_port(), str(tiny_model_dir), str(tmp_path), redis_server.url),
        nprocs=2,
        start_method="spawn",
        join=True,
    )

    sharded = tmp_path / "sharded" / "checkpoints"
    assert (sharded / "step_000001" / "dcp" / ".metadata").is_file()  # every rank's shards, by DCP
    assert (sharded / "step_000002" / "dcp" / ".metadata").is_file()
    config = (sharded / "step_000002" / "model" / "config.json").read_text()
    assert "FSDP" not in config  # the export is the plain architecture, loadable anywhere
    initial = load_model(ModelConfig(path=tiny_model_dir))
    for step in (1, 2):
        want, got = _weights(tmp_path / "replicated", step), _weights(tmp_path / "sharded", step)
        assert set(want) == set(got)
        for name, w in want.items():
            # float32 gradients that differ only in summation order (reduce-scatter vs all-reduce), through AdamW:
            # an update is ~lr (1e-3) per element, so rounding differences stay many orders below it
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6)
        # what inference serves after each sharded run is bit for bit the trained weights (gathered, streamed)
        served = torch.load(tmp_path / "sharded" / f"served-{step}.pt")
        assert set(served) == set(got) and all(torch.equal(served[n], got[n]) for n in got)
        moved = max(float((want[n] - p.detach()).abs().max()) for n, p in initial.named_parameters())
        assert moved > 1e-4  # the step changed the weights (the comparison is not between two untouched models)


if __name__ == "__main__":  # spawn re-imports this module
    sys.exit(0)
