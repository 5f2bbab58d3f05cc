"""The rollout service's client: status, pause and resume, and its run config."""

from __future__ import annotations

from relayrl.client.base import ServiceClient
from relayrl.common.pb import common_pb2, rollout_pb2, rollout_pb2_grpc

__all__ = ["RolloutClient"]


class RolloutClient(ServiceClient):
    stub_class = rollout_pb2_grpc.RolloutServiceStub

    async def status(self) -> rollout_pb2.RolloutStatus:
        return await self.call(
            self.stub.GetStatus, rollout_pb2.GetRolloutStatusRequest(), policy=self.policy_for("GetStatus")
        )

    async def pause(self, reason: str = "") -> rollout_pb2.RolloutStatus:
        return await self.call(
            self.stub.Pause, rollout_pb2.PauseRequest(reason=reason), mutating=True, policy=self.policy_for("Pause")
        )

    async def resume(self) -> rollout_pb2.RolloutStatus:
        return await self.call(
            self.stub.Resume, rollout_pb2.ResumeRequest(), mutating=True, policy=self.policy_for("Resume")
        )

    async def config(self) -> str:
        return (
            await self.call(self.stub.GetConfig, common_pb2.GetConfigRequest(), policy=self.policy_for("GetConfig"))
        ).yaml
