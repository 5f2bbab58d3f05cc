"""The trainer's gRPC servicer and REST control plane (rank 0): status, checkpoint requests, the config."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI

from relayrl.common.control import redacted_yaml, require_token
from relayrl.common.control_api import control_app
from relayrl.common.grpc_admission import method_path
from relayrl.common.grpc_utils import ServerHandle, create_server
from relayrl.common.pb import trainer_pb2, trainer_pb2_grpc
from relayrl.common.pb.common_pb2 import GetConfigRequest, RunConfigText
from relayrl.trainer.metrics import trainer_metrics
from relayrl.trainer.runtime import Trainer
from relayrl.trainer.status_watch import MAX_WATCHERS, status_changes

log = logging.getLogger(__name__)


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.token = trainer.cfg.control.effective_token()
        self.watchers = 0

    async def request_checkpoint(self, reason: str = "") -> trainer_pb2.CheckpointReply:
        trainer = self.trainer
        if not trainer.checkpoints.requested:
            log.info(
                "checkpoint requested after step %d%s", trainer.progress.step + 1, f" ({reason})" if reason else ""
            )
        return trainer_pb2.CheckpointReply(after_step=trainer.request_checkpoint())

    async def RequestCheckpoint(
        self, request: trainer_pb2.CheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.CheckpointReply:
        await require_token(context, self.token)
        return await self.request_checkpoint(request.reason)

    async def GetConfig(self, request: GetConfigRequest, context: grpc.aio.ServicerContext) -> RunConfigText:
        return RunConfigText(yaml=redacted_yaml(self.trainer.cfg))

    def http_app(self) -> FastAPI:
        trainer = self.trainer
        return control_app(
            "trainer",
            trainer.status,
            lambda: redacted_yaml(trainer.cfg),
            self.token,
            trainer_metrics(trainer),
            {"/checkpoint": self.request_checkpoint},
        )

    async def GetStatus(
        self, request: trainer_pb2.GetTrainerStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        # drops are read live: a group dropped by any rank releases rollout's admission at once
        await self.trainer.refresh_drops()
        return self.trainer.status()

    async def WatchStatus(
        self, request: trainer_pb2.WatchTrainerStatusRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.TrainerStatus]:
        if self.watchers >= MAX_WATCHERS:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"the trainer already serves {MAX_WATCHERS} status watchers"
            )
        self.watchers += 1
        try:
            trainer = self.trainer
            async for status in status_changes(trainer.progress.changed, trainer.status, trainer.refresh_drops):
                yield status
        finally:
            self.watchers -= 1


def create_trainer_server(trainer: Trainer) -> tuple[ServerHandle, TrainerServicer]:
    servicer = TrainerServicer(trainer)
    name = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
    handle = create_server(
        trainer.cfg.trainer.server,
        [lambda s: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, s)],
        [name],
        trainer.cfg.tls,
        tokens={method_path(name, "RequestCheckpoint"): servicer.token},
        section="trainer.server",
    )
    return handle, servicer
