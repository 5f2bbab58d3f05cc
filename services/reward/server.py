"""The reward gRPC service: scores completions; failures are explicit error results."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from relayrl.common.grpc_utils import ServerHandle, create_server
from relayrl.common.logging import bind_log_context
from relayrl.common.pb import reward_pb2 as pb
from relayrl.common.pb import reward_pb2_grpc as pb_grpc
from relayrl.common.service import StatusHeader
from relayrl.reward.api import RewardFn, RewardInput, is_async, normalize_result
from relayrl.reward.config import RewardConfig

log = logging.getLogger(__name__)


def _metadata(raw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


class RewardServicer(pb_grpc.RewardServiceServicer):
    def __init__(self, cfg: RewardConfig, fn: RewardFn) -> None:
        self.cfg = cfg
        self.fn = fn
        self._async = is_async(fn)
        self.header = StatusHeader("reward")
        self._executor = ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="verifier")
        self.scored = 0
        self.errors = 0
        self.timeouts = 0

    async def _call(self, inp: RewardInput) -> Any:
        if self._async:
            return await self.fn(inp)  # type: ignore[misc]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.fn, inp)

    async def score_one(self, req: pb.ScoreRequest) -> pb.ScoreResponse:
        bind_log_context(episode_id=req.episode_id)  # one task per episode (the RPC's, or ScoreBatch's gather)
        inp = RewardInput(prompt=req.prompt, completion=req.completion, reference=req.reference,
                          metadata=_metadata(req.metadata))
        try:
            value = await asyncio.wait_for(self._call(inp), timeout=self.cfg.timeout_s)
            result = normalize_result(value)
        except TimeoutError:
            self.timeouts += 1
            log.warning("verifier timed out after %.1fs (episode %s)", self.cfg.timeout_s, req.episode_id)
            return pb.ScoreResponse(episode_id=req.episode_id, status=pb.SCORE_STATUS_TIMEOUT,
                                    error=f"verifier did not finish within {self.cfg.timeout_s}s")
        except Exception as exc:  # a broken verifier is an error result, never a 0
            self.errors += 1
            log.warning("verifier failed (episode %s): %s: %s", req.episode_id, type(exc).__name__, exc)
            return pb.ScoreResponse(episode_id=req.episode_id, status=pb.SCORE_STATUS_ERROR,
                                    error=f"{type(exc).__name__}: {exc}")
        self.scored += 1
        return pb.ScoreResponse(episode_id=req.episode_id, status=pb.SCORE_STATUS_OK, score=result.score,
                                components={k: float(v) for k, v in result.components.items()},
                                details=result.details)

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        return await self.score_one(request)

    async def ScoreBatch(self, request: pb.ScoreBatchRequest,
                         context: grpc.aio.ServicerContext) -> pb.ScoreBatchResponse:
        if len(request.requests) > self.cfg.max_batch:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"batch of {len(request.requests)} exceeds max_batch={self.cfg.max_batch}")
        responses = await asyncio.gather(*(self.score_one(r) for r in request.requests))
        return pb.ScoreBatchResponse(responses=responses)

    async def GetStatus(self, request: pb.GetRewardStatusRequest,
                        context: grpc.aio.ServicerContext) -> pb.RewardStatus:
        return pb.RewardStatus(component=self.header.message(), reward_function=self.cfg.function,
                               scored=self.scored, errors=self.errors, timeouts=self.timeouts)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def create_reward_server(cfg: RewardConfig, fn: RewardFn) -> tuple[ServerHandle, RewardServicer]:
    servicer = RewardServicer(cfg, fn)
    handle = create_server(
        cfg.server,
        [lambda s: pb_grpc.add_RewardServiceServicer_to_server(servicer, s)],
        [pb.DESCRIPTOR.services_by_name["RewardService"].full_name],
    )
    return handle, servicer
