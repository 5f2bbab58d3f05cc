"""The trainer service's client: status (once or as a stream), checkpoint requests, and its run config."""

from __future__ import annotations

from collections.abc import AsyncIterator

from relayrl.client.base import ServiceClient
from relayrl.common.pb import common_pb2, trainer_pb2, trainer_pb2_grpc

__all__ = ["TrainerClient"]


class TrainerClient(ServiceClient):
    stub_class = trainer_pb2_grpc.TrainerServiceStub

    async def status(self) -> trainer_pb2.TrainerStatus:
        return await self.call(
            self.stub.GetStatus, trainer_pb2.GetTrainerStatusRequest(), policy=self.policy_for("GetStatus")
        )

    async def watch_status(self, timeout_s: float) -> AsyncIterator[trainer_pb2.TrainerStatus]:
        """The trainer's status now and at each change, until the run finishes or ``timeout_s`` (the stream's
        deadline: DEADLINE_EXCEEDED then, and the caller subscribes again). Not retried: the caller decides."""
        call = self.stub.WatchStatus(
            trainer_pb2.WatchTrainerStatusRequest(),
            timeout=timeout_s,
            metadata=self._auth() if self.authenticate_all else None,
        )
        try:
            async for status in call:
                yield status
        finally:
            call.cancel()

    async def request_checkpoint(self, reason: str = "") -> trainer_pb2.CheckpointReply:
        return await self.call(
            self.stub.RequestCheckpoint,
            trainer_pb2.CheckpointRequest(reason=reason),
            mutating=True,
            policy=self.policy_for("RequestCheckpoint"),
        )

    async def config(self) -> str:
        return (
            await self.call(self.stub.GetConfig, common_pb2.GetConfigRequest(), policy=self.policy_for("GetConfig"))
        ).yaml
