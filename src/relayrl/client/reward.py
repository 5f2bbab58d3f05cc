"""The reward service's client: scoring episodes and running code in its sandbox."""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.client.base import ServiceClient
from relayrl.common.pb import reward_pb2, reward_pb2_grpc

__all__ = ["RewardClient"]


class RewardClient(ServiceClient):
    """Scoring is stateless, so calls go round robin over every reward replica the target names: a headless
    Service's pods (re-resolved as the server's bounded connection age closes connections), or a list
    ``ipv4:10.0.0.5:50052,10.0.0.6:50052``; a replica that goes away leaves the rotation when its connection closes,
    and a call it failed UNAVAILABLE is retried on the others by the caller's policy."""

    stub_class = reward_pb2_grpc.RewardServiceStub
    balanced = True

    async def status(self) -> reward_pb2.RewardStatus:
        return await self.call(
            self.stub.GetStatus, reward_pb2.GetRewardStatusRequest(), policy=self.policy_for("GetStatus")
        )

    # Score and ScoreBatch send the client's token (the code token) when it has one: a reward that runs code (the
    # code verifier) scores only for its holders; a pure reward ignores it.
    async def score(self, request: reward_pb2.ScoreRequest, timeout_s: float = 60.0) -> reward_pb2.ScoreResponse:
        return await self.call(self.stub.Score, request, timeout_s, mutating=True, policy=self.policy_for("Score"))

    async def score_batch(
        self, requests: Sequence[reward_pb2.ScoreRequest], timeout_s: float = 60.0
    ) -> reward_pb2.ScoreBatchResponse:
        """Score several episodes in one call; the responses come in the order of ``requests``."""
        return await self.call(
            self.stub.ScoreBatch,
            reward_pb2.ScoreBatchRequest(requests=requests),
            timeout_s,
            mutating=True,
            policy=self.policy_for("ScoreBatch"),
        )

    async def run_code(
        self, code: str, stdin: bytes = b"", timeout_s: float = 10.0, run_timeout_s: float = 0.0, memory_mb: int = 0
    ) -> reward_pb2.RunCodeResponse:
        """Run one Python program in the reward service's code sandbox (needs the client's ``token``: the code
        token). ``timeout_s`` is the call's deadline; ``run_timeout_s`` and ``memory_mb`` the run's own limits
        (0: the service's; more than it allows is RESOURCE_EXHAUSTED)."""
        request = reward_pb2.RunCodeRequest(code=code, stdin=stdin, timeout_s=run_timeout_s, memory_mb=memory_mb)
        return await self.call(self.stub.RunCode, request, timeout_s, mutating=True, policy=self.policy_for("RunCode"))
