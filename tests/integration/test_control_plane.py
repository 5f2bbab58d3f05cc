"""The control plane on a live in-process stack: pause/resume generation, checkpoint on request, config views,
bearer tokens on mutating calls, Prometheus series, and `relayrl status` through the typed clients."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from relayrl.client import RolloutClient, TrainerClient
from relayrl.common.control import redacted
from relayrl.common.dataset import PromptCursor, open_prompts
from relayrl.common.http import HttpServer
from relayrl.common.stream import EpisodeStream
from relayrl.config import RunConfig
from relayrl.config.control import ControlConfig
from relayrl.config.endpoints import HttpConfig
from relayrl.rollout.clients import RolloutClients
from relayrl.rollout.producer import RolloutProducer
from relayrl.rollout.server import create_rollout_server
from relayrl.status import Target, collect, render
from relayrl.tasks.arithmetic import reward
from relayrl.trainer.runtime import Trainer
from relayrl.trainer.server import create_trainer_server
from tests.conftest import RedisServer
from tests.integration.helpers import inference_server, reward_server, with_services
from tests.integration.stack import stack_config
from tests.polling import until

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _pause_over_rest_then_resume_over_grpc(
    worker: RolloutProducer, cfg: RunConfig, rest_port: int, rollout_target: str
) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{rest_port}", timeout=10) as rest:
        # pause over REST: refused without the token, then granted
        assert (await rest.post("/pause")).status_code == 401
        paused = await rest.post("/pause", headers=AUTH)
        assert paused.status_code == 200 and paused.json()["paused"] is True
        assert await until(lambda: worker.running == 0, 60)
        produced = worker.groups_produced
        for _ in range(3):  # wake the admission loop (as a trainer status change does): each decision refuses
            decided = worker.refused_while_paused
            worker._wake.set()
            assert await until(lambda d=decided: worker.refused_while_paused > d, 60)  # type: ignore[misc]
        assert worker.groups_produced == produced  # nothing new is admitted while paused
        metrics = (await rest.get("/metrics")).text
        assert "relayrl_rollout_paused 1.0" in metrics
        config = yaml.safe_load((await rest.get("/config")).text)
        assert config["rollout"]["group_size"] == cfg.rollout.group_size
    # resume over gRPC with the typed client
    async with RolloutClient(rollout_target, token="wrong") as bad:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await bad.resume()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with RolloutClient(rollout_target, token=TOKEN) as rollout:
        assert (await rollout.resume()).paused is False
    assert await until(lambda: worker.groups_produced > produced, 60)


async def _checkpoint_on_request(trainer: Trainer, cfg: RunConfig, trainer_target: str, rest_port: int) -> None:
    # a checkpoint on request, though checkpoint_every is 0
    async with TrainerClient(trainer_target, token=TOKEN) as client:
        reply = await client.request_checkpoint("test")
        assert await until(lambda: trainer.checkpoints.last_step >= reply.after_step, 60)
        status = await client.status()
    assert status.last_checkpoint_step >= reply.after_step and not status.checkpoint_pending
    assert (cfg.checkpoint_dir / f"step_{trainer.checkpoints.last_step:06d}" / "model").is_dir()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{rest_port}", timeout=10) as rest:
        assert "relayrl_trainer_step" in (await rest.get("/metrics")).text
        assert (await rest.post("/checkpoint")).status_code == 401


async def _status_of_the_run(
    cfg: RunConfig, trainer_target: str, rollout_target: str, inf_target: str, rew_target: str
) -> None:
    # status through the clients: the trainer found by asking, and the run as a whole
    one = await collect(Target(None, None, trainer_target))
    assert one["services"]["trainer"]["step"] >= 2
    live = replace(
        cfg,
        trainer=replace(cfg.trainer, server=replace(cfg.trainer.server, address=trainer_target)),
        rollout=replace(cfg.rollout, server=replace(cfg.rollout.server, address=rollout_target)),
        inference=replace(cfg.inference, server=replace(cfg.inference.server, address=inf_target)),
        reward=replace(cfg.reward, server=replace(cfg.reward.server, address=rew_target)),
    )
    state = await collect(Target(live, cfg.output_dir, None))
    assert all("error" not in s for s in state["services"].values()), state
    # acknowledged entries are trimmed at the checkpoint: the pending ones stay
    assert state["queue"]["length"] >= state["queue"]["pending"] and "lag" in state["queue"]
    assert state["queue"]["invalid_groups"] == 0
    assert state["training"]["step"] >= 2
    assert "trainer" in render(state) and "queue" in render(state)


async def test_operator_pauses_resumes_and_checkpoints_a_live_stack_with_a_token(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAYRL_CONTROL_TOKEN", TOKEN)
    cfg = stack_config(
        tmp_path / "run",
        tiny_model_dir,
        dataset_path,
        redis_server.url,
        "trainer.total_steps=500",
        "trainer.checkpoint.every=0",
        "rollout.max_concurrent_groups=2",
    )
    http = HttpConfig(host="127.0.0.1", port=0)

    async def go() -> None:
        async with inference_server(tiny_model_dir) as (inf_target, inf), reward_server(reward) as (rew_target, _):
            trainer = Trainer(with_services(cfg, inf_target, inf.weights_target))
            t_handle, t_servicer = create_trainer_server(trainer)
            t_http = HttpServer(t_servicer.http_app(), http, "trainer")
            await t_handle.start()
            await t_http.start()
            stream = EpisodeStream.from_config(cfg.redis, cfg.name)
            trainer_target = f"127.0.0.1:{t_handle.port}"
            async with RolloutClients.connect(inf_target, rew_target, trainer_target) as clients:
                worker = RolloutProducer(
                    cfg.rollout, stream, PromptCursor(open_prompts(cfg.rollout.dataset_spec()).train, True, 0), clients
                )
                r_handle, r_servicer = create_rollout_server(worker, cfg, replace(cfg.rollout.server, port=0))
                r_http = HttpServer(r_servicer.http_app(), http, "rollout")
                await r_handle.start()
                await r_http.start()
                rollout_target = f"127.0.0.1:{r_handle.port}"
                stop = asyncio.Event()
                tasks = [asyncio.create_task(trainer.train()), asyncio.create_task(worker.run(stop))]
                try:
                    assert await until(lambda: trainer.progress.step >= 2, 60)
                    await _pause_over_rest_then_resume_over_grpc(worker, cfg, r_http.port, rollout_target)
                    await _checkpoint_on_request(trainer, cfg, trainer_target, t_http.port)
                    await _status_of_the_run(cfg, trainer_target, rollout_target, inf_target, rew_target)
                finally:
                    stop.set()
                    tasks[0].cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    await r_http.stop()
                    await r_handle.stop(0)
            await t_http.stop()
            await t_handle.stop(0)
            await trainer.close()
            await stream.close()

    await go()


def test_config_views_redact_the_token_and_the_redis_password(tmp_path: Path) -> None:
    from relayrl.config import load_run_config

    cfg = load_run_config(None, ["redis.url=redis://user:hunter2@db:6379/0", f"control.token={TOKEN}"])

    data = redacted(cfg)

    assert data["control"]["token"] == "***"
    assert data["redis"]["url"] == "redis://user:***@db:6379/0"
    assert TOKEN not in str(data) and "hunter2" not in str(data)
    assert ControlConfig().effective_token() in ("", TOKEN)
