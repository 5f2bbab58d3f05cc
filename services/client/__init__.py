"""Typed Python clients of relayrl's services (what the CLI uses).

Every call has a deadline; only UNAVAILABLE (a transient fault) is retried, with exponential back-off, and every
service call that can be repeated is idempotent on the server side. Mutating control calls send the bearer token
(``authorization`` metadata) when one is given.

    async with TrainerClient("localhost:50054", token="...") as trainer:
        status = await trainer.status()
        await trainer.request_checkpoint("before the upgrade")
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc

from relayrl.common.grpc_utils import CHANNEL_OPTIONS
from relayrl.common.pb import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

R = TypeVar("R")

__all__ = ["InferenceClient", "RewardClient", "RolloutClient", "ServiceClient", "TrainerClient"]


class ServiceClient:
    """A channel to one service, with a default deadline and retries on UNAVAILABLE only."""

    stub_class: Any = None

    def __init__(self, target: str, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.2,
                 token: str = "") -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.token = token
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = self.stub_class(self.channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def call(self, method: Callable[..., Awaitable[R]], request: Any, timeout_s: float | None = None,
                   mutating: bool = False) -> R:
        metadata = (("authorization", f"Bearer {self.token}"),) if mutating and self.token else None
        for attempt in range(self.retries + 1):
            try:
                return await method(request, timeout=timeout_s or self.timeout_s, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.retries:
                    raise
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")


class InferenceClient(ServiceClient):
    stub_class = inference_pb2_grpc.InferenceServiceStub

    async def status(self) -> inference_pb2.InferenceStatus:
        return await self.call(self.stub.GetStatus, inference_pb2.GetInferenceStatusRequest())

    async def generate(self, prompt: str | list[int], sampling: inference_pb2.SamplingParams,
                       timeout_s: float = 120.0) -> inference_pb2.GenerateResponse:
        request = (inference_pb2.GenerateRequest(prompt_text=prompt, sampling=sampling) if isinstance(prompt, str)
                   else inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=prompt),
                                                      sampling=sampling))
        return await self.call(self.stub.Generate, request, timeout_s)

    async def update_weights(self, messages: Sequence[inference_pb2.WeightUpdateMessage], version: int,
                             timeout_s: float, attempts: int = 5) -> inference_pb2.UpdateWeightsResponse | None:
        """Push one weight update (its chunks, then the manifest, on the UpdateWeights client stream) with a
        deadline of ``timeout_s`` per attempt.

        A push that timed out (DEADLINE_EXCEEDED) or met UNAVAILABLE may still have been applied, so before
        retrying it asks the served version: when inference serves ``version`` the push landed and this returns
        None (applied; its answer, with the probe logprobs, was lost). A retry refused as stale
        (FAILED_PRECONDITION) because ``version`` is served reads the same. Any other failure, or the last
        attempt's, raises grpc.aio.AioRpcError. Back-off between attempts: ``backoff_s`` x attempt."""
        retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        for attempt in range(1, attempts + 1):
            try:
                response: inference_pb2.UpdateWeightsResponse = await self.stub.UpdateWeights(
                    iter(messages), timeout=timeout_s)
                return response
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (*retryable, grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                if await self._serves(version):
                    return None
                if exc.code() not in retryable or attempt == attempts:
                    raise
                await asyncio.sleep(self.backoff_s * attempt)
        raise AssertionError("unreachable")

    async def _serves(self, version: int) -> bool:
        """Whether inference serves ``version`` now (False when it cannot tell)."""
        try:
            return int((await self.status()).weight_version) == version
        except grpc.aio.AioRpcError:
            return False


class RewardClient(ServiceClient):
    stub_class = reward_pb2_grpc.RewardServiceStub

    async def status(self) -> reward_pb2.RewardStatus:
        return await self.call(self.stub.GetStatus, reward_pb2.GetRewardStatusRequest())

    async def score(self, request: reward_pb2.ScoreRequest, timeout_s: float = 60.0) -> reward_pb2.ScoreResponse:
        return await self.call(self.stub.Score, request, timeout_s)


class RolloutClient(ServiceClient):
    stub_class = rollout_pb2_grpc.RolloutServiceStub

    async def status(self) -> rollout_pb2.RolloutStatus:
        return await self.call(self.stub.GetStatus, rollout_pb2.GetRolloutStatusRequest())

    async def pause(self, reason: str = "") -> rollout_pb2.RolloutStatus:
        return await self.call(self.stub.Pause, rollout_pb2.PauseRequest(reason=reason), mutating=True)

    async def resume(self) -> rollout_pb2.RolloutStatus:
        return await self.call(self.stub.Resume, rollout_pb2.ResumeRequest(), mutating=True)

    async def config(self) -> str:
        return (await self.call(self.stub.GetConfig, common_pb2.GetConfigRequest())).yaml


class TrainerClient(ServiceClient):
    stub_class = trainer_pb2_grpc.TrainerServiceStub

    async def status(self) -> trainer_pb2.TrainerStatus:
        return await self.call(self.stub.GetStatus, trainer_pb2.GetTrainerStatusRequest())

    async def request_checkpoint(self, reason: str = "") -> trainer_pb2.CheckpointReply:
        return await self.call(self.stub.RequestCheckpoint, trainer_pb2.CheckpointRequest(reason=reason),
                               mutating=True)

    async def config(self) -> str:
        return (await self.call(self.stub.GetConfig, common_pb2.GetConfigRequest())).yaml
