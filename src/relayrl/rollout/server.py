"""The rollout service's gRPC servicer (status, pause/resume, config) and its REST control plane."""

from __future__ import annotations

import grpc
from fastapi import FastAPI

from relayrl.client.inference_pool import replica_counts
from relayrl.common.control import redacted_yaml, require_token
from relayrl.common.control_api import control_app
from relayrl.common.grpc_admission import method_path
from relayrl.common.grpc_utils import ServerHandle, create_server
from relayrl.common.pb import rollout_pb2, rollout_pb2_grpc
from relayrl.common.pb.common_pb2 import GetConfigRequest, RunConfigText
from relayrl.common.service import StatusHeader
from relayrl.config import RunConfig
from relayrl.config.endpoints import ServerConfig
from relayrl.rollout.metrics import rollout_metrics
from relayrl.rollout.producer import RolloutProducer


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, producer: RolloutProducer, cfg: RunConfig) -> None:
        self.producer = producer
        self.cfg = cfg
        self.token = cfg.control.effective_token()
        self.header = StatusHeader("rollout")

    def status(self) -> rollout_pb2.RolloutStatus:
        p = self.producer
        epoch, index = p.cursor.position(p.next_seq)
        return rollout_pb2.RolloutStatus(
            component=self.header.message(),
            groups_produced=p.groups_produced,
            episodes_produced=p.episodes_produced,
            groups_running=p.running,
            groups_failed=p.groups_failed,
            dataset_epoch=epoch,
            dataset_index=index,
            trainer_version=p.trainer_view.weight_version,
            paused=p.paused,
            redis_oom_retries=p.redis_oom_retries,
            append_blocked=p.append_blocked,
            episode_turns=p.turns.turns,
            tool_calls=p.turns.tool_calls,
            tool_errors=p.turns.tool_errors,
            episode_ends=dict(p.turns.ends),
            **replica_counts(p.clients.inference),
        )

    async def pause(self, reason: str = "") -> rollout_pb2.RolloutStatus:
        self.producer.set_paused(True, reason)
        return self.status()

    async def resume(self) -> rollout_pb2.RolloutStatus:
        self.producer.set_paused(False)
        return self.status()

    async def GetStatus(
        self, request: rollout_pb2.GetRolloutStatusRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.RolloutStatus:
        return self.status()

    async def Pause(
        self, request: rollout_pb2.PauseRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.RolloutStatus:
        await require_token(context, self.token)
        return await self.pause(request.reason)

    async def Resume(
        self, request: rollout_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.RolloutStatus:
        await require_token(context, self.token)
        return await self.resume()

    async def GetConfig(self, request: GetConfigRequest, context: grpc.aio.ServicerContext) -> RunConfigText:
        return RunConfigText(yaml=redacted_yaml(self.cfg))

    def http_app(self) -> FastAPI:
        return control_app(
            "rollout",
            self.status,
            lambda: redacted_yaml(self.cfg),
            self.token,
            rollout_metrics(self.status),
            {"/pause": self.pause, "/resume": self.resume},
        )


def create_rollout_server(
    producer: RolloutProducer, cfg: RunConfig, server: ServerConfig | None = None
) -> tuple[ServerHandle, RolloutServicer]:
    """The gRPC server (``server``, else ``rollout.server``) and its servicer, not started."""
    servicer = RolloutServicer(producer, cfg)
    name = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
    handle = create_server(
        server or cfg.rollout.server,
        [lambda s: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, s)],
        [name],
        cfg.tls,
        tokens={method_path(name, m): servicer.token for m in ("Pause", "Resume")},
        section="rollout.server",
    )
    return handle, servicer
