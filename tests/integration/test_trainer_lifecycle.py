"""A finished run stays finished: a trainer restarted on a run that reached total_steps trains nothing and pushes
no weights, and with trainer.after_finish stay it keeps serving its status until stopped (what a StatefulSet pod
needs: a container that exits is restarted, forever)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from relayrl.common.pb import trainer_pb2, trainer_pb2_grpc
from relayrl.common.stream import EpisodeStream
from relayrl.config import RunConfig
from relayrl.config.trainer import AfterFinish
from relayrl.trainer.main import serve
from relayrl.trainer.runtime import Trainer
from relayrl.trainer.versions import VersionSource
from tests.conftest import RedisServer, free_port
from tests.integration.stack import run_stack, stack_config

pytestmark = pytest.mark.integration


async def _latest_version(cfg: RunConfig) -> int:
    stream = EpisodeStream.from_config(cfg.redis, cfg.name)
    try:
        return await VersionSource(stream.client, stream.keys).latest()
    finally:
        await stream.close()


@pytest.fixture
def finished_run(tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer) -> RunConfig:
    cfg = stack_config(
        tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url, "trainer.checkpoint.resume=auto"
    )
    asyncio.run(run_stack(cfg, tiny_model_dir))
    return cfg


async def test_a_trainer_restarted_on_a_finished_run_trains_nothing_and_pushes_no_weights(
    finished_run: RunConfig,
) -> None:
    cfg = finished_run
    rows_before = cfg.metrics_path.read_text()
    version_before = await _latest_version(cfg)

    async def restart() -> tuple[bool, int]:
        trainer = Trainer(cfg)  # inference is gone: any push would fail the run
        try:
            await asyncio.wait_for(trainer.train(), timeout=60)
            return trainer.progress.finished, trainer.progress.step
        finally:
            await trainer.close()

    finished, step = await restart()

    assert (finished, step) == (True, cfg.trainer.total_steps)
    assert await _latest_version(cfg) == version_before  # no version allocated, none reused
    assert cfg.metrics_path.read_text() == rows_before  # no step trained, none logged twice
    assert sorted(p.name for p in cfg.checkpoint_dir.iterdir())[-1] == f"step_{cfg.trainer.total_steps:06d}"


async def test_a_finished_trainer_set_to_stay_serves_finished_until_stopped(
    finished_run: RunConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAYRL_WEIGHTS_TOKEN", "w" * 32)
    port = free_port()
    tc = finished_run.trainer
    cfg = replace(
        finished_run,
        trainer=replace(
            tc,
            after_finish=AfterFinish.STAY,
            server=replace(tc.server, port=port),
            http=replace(tc.http, enabled=False),
        ),
    )

    async def go() -> tuple[bool, bool, bool]:
        stop = asyncio.Event()
        task = asyncio.create_task(serve(cfg, stop))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            status = await stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=60, wait_for_ready=True)
            # the run is over, yet the process stays: bounded check that serve() has not returned
            done, _ = await asyncio.wait({task}, timeout=3)
            stayed = not done
            again = await stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10)
        stop.set()  # SIGTERM
        await asyncio.wait_for(task, timeout=30)
        return status.finished, stayed, again.finished

    finished, stayed, still_finished = await go()

    assert finished and still_finished
    assert stayed
    assert json.loads(cfg.metrics_path.read_text().splitlines()[-1])["step"] == tc.total_steps
