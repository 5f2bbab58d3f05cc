"""Entry point of the rollout service: the rollout loop plus a status server."""

from __future__ import annotations

import asyncio
import json
import logging
import signal

import grpc
from fastapi import FastAPI

from relayrl.common.control import redacted_yaml, require_token
from relayrl.common.control_api import control_app
from relayrl.common.dataset import PromptCursor, load_jsonl
from relayrl.common.grpc_utils import create_server, insecure_channel
from relayrl.common.http import HttpServer
from relayrl.common.pb import inference_pb2_grpc, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc, trainer_pb2_grpc
from relayrl.common.pb.common_pb2 import GetConfigRequest, RunConfigText, ServingState
from relayrl.common.service import StatusHeader
from relayrl.common.stream import EpisodeStream
from relayrl.config import RunConfig
from relayrl.rollout.metrics import rollout_metrics
from relayrl.rollout.worker import RolloutWorker

log = logging.getLogger(__name__)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, worker: RolloutWorker, cfg: RunConfig) -> None:
        self.worker = worker
        self.cfg = cfg
        self.token = cfg.control.effective_token()
        self.header = StatusHeader("rollout")

    def status(self) -> rollout_pb2.RolloutStatus:
        w = self.worker
        epoch, index = w.cursor.position(w.next_seq)
        return rollout_pb2.RolloutStatus(
            component=self.header.message(), groups_produced=w.groups_produced,
            episodes_produced=w.episodes_produced, groups_running=w.running, groups_failed=w.groups_failed,
            dataset_epoch=epoch, dataset_index=index, trainer_version=w.trainer_view.weight_version,
            paused=w.paused)

    async def pause(self, reason: str = "") -> rollout_pb2.RolloutStatus:
        self.worker.set_paused(True, reason)
        return self.status()

    async def resume(self) -> rollout_pb2.RolloutStatus:
        self.worker.set_paused(False)
        return self.status()

    async def GetStatus(self, request: rollout_pb2.GetRolloutStatusRequest,
                        context: grpc.aio.ServicerContext) -> rollout_pb2.RolloutStatus:
        return self.status()

    async def Pause(self, request: rollout_pb2.PauseRequest,
                    context: grpc.aio.ServicerContext) -> rollout_pb2.RolloutStatus:
        await require_token(context, self.token)
        return await self.pause(request.reason)

    async def Resume(self, request: rollout_pb2.ResumeRequest,
                     context: grpc.aio.ServicerContext) -> rollout_pb2.RolloutStatus:
        await require_token(context, self.token)
        return await self.resume()

    async def GetConfig(self, request: GetConfigRequest, context: grpc.aio.ServicerContext) -> RunConfigText:
        return RunConfigText(yaml=redacted_yaml(self.cfg))

    def http_app(self) -> FastAPI:
        return control_app("rollout", self.status, lambda: redacted_yaml(self.cfg), self.token,
                           rollout_metrics(self.status), {"/pause": self.pause, "/resume": self.resume})


async def serve(cfg: RunConfig, stop: asyncio.Event | None = None) -> None:
    rc = cfg.rollout
    cfg.redis.require_url()
    rows = load_jsonl(rc.dataset)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stream = EpisodeStream.from_url(cfg.redis.url, cfg.redis.stream, cfg.redis.group)
    async with insecure_channel(cfg.inference.server.target) as inf, \
            insecure_channel(cfg.reward.server.target) as rew, \
            insecure_channel(cfg.trainer.server.target) as tr:
        worker = RolloutWorker(rc, stream, PromptCursor(rows, rc.shuffle, rc.seed),
                               inference_pb2_grpc.InferenceServiceStub(inf), reward_pb2_grpc.RewardServiceStub(rew),
                               trainer_pb2_grpc.TrainerServiceStub(tr), redis_retry_s=cfg.redis.retry_s)
        servicer = RolloutServicer(worker, cfg)
        handle = create_server(
            rc.server, [lambda s: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, s)],
            [rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name])
        http = HttpServer(servicer.http_app(), rc.http, "rollout") if rc.http.enabled else None
        await handle.start()
        if http is not None:
            await http.start()
        servicer.header.state = ServingState.SERVING_STATE_SERVING
        log.info("rollout serving status on port %d; %d prompts from %s", handle.port, len(rows), rc.dataset)
        try:
            await worker.run(stop)
            if not stop.is_set():
                log.info("trainer finished; rollout waits for shutdown")
                await stop.wait()
        finally:
            if http is not None:
                await http.stop()
            await handle.stop(rc.server.shutdown_grace_s)
            await stream.close()
            cfg.output_dir.mkdir(parents=True, exist_ok=True)
            (cfg.output_dir / "rollout_state.json").write_text(json.dumps(worker.state(), indent=1) + "\n")
            log.info("rollout state: %s", worker.state())
