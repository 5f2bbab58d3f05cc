"""The reward gRPC service: scores completions in the verifier pool; failures are explicit error results."""

from __future__ import annotations

import logging

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from relayrl.common.control import require_token
from relayrl.common.grpc_admission import method_path
from relayrl.common.grpc_utils import ServerHandle, create_server
from relayrl.common.logging import log_context
from relayrl.common.pb import reward_pb2 as pb
from relayrl.common.pb import reward_pb2_grpc as pb_grpc
from relayrl.common.pb.common_pb2 import ServingState
from relayrl.common.reward_metadata import decode_metadata
from relayrl.common.service import StatusHeader
from relayrl.config.reward import RewardConfig
from relayrl.config.tls import TlsConfig
from relayrl.reward.api import RewardInput
from relayrl.reward.code_runs import RefusedRun, check_request, status_label, to_response
from relayrl.reward.pool import VerifierPool
from relayrl.reward.protocol import Outcome, Status
from relayrl.reward.sandbox import Sandbox
from relayrl.reward.scorer import Scorer, ScorerSpec

log = logging.getLogger(__name__)


class RewardMetrics:
    """Prometheus metrics of one reward service (its own registry: several services may share a process)."""

    def __init__(self, pool: VerifierPool) -> None:
        self.registry = CollectorRegistry()
        self.scores = Counter(
            "relayrl_reward_scores", "Requests scored, by result status.", ["status"], registry=self.registry
        )
        for status in Status:
            self.scores.labels(status.value)
        self.restarts = Counter(
            "relayrl_reward_worker_restarts",
            "Verifier workers killed and replaced.",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("timeout", "crash"):
            self.restarts.labels(reason)
        self.seconds = Histogram(
            "relayrl_reward_verify_seconds",
            "Time a verifier took on one request.",
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.code_runs = Counter(
            "relayrl_reward_code_runs", "RunCode programs, by how they ended.", ["status"], registry=self.registry
        )
        for label in ("exited", "timeout", "output_exceeded", "error", "refused"):
            self.code_runs.labels(label)
        Gauge("relayrl_reward_workers_ready", "Verifier workers alive and ready.", registry=self.registry).set_function(
            lambda: pool.ready_workers
        )
        Gauge("relayrl_reward_workers_busy", "Verifier workers scoring now.", registry=self.registry).set_function(
            lambda: pool.busy_workers
        )
        Gauge("relayrl_reward_queued", "Requests waiting for a worker.", registry=self.registry).set_function(
            lambda: pool.queued
        )


SCORE_CALL = "scoring with a reward that runs code"


class RewardServicer(pb_grpc.RewardServiceServicer):
    """``code_token``: the bearer token RunCode needs (empty: RunCode is refused), and Score/ScoreBatch too when the
    reward runs programs (``runs_code``: the code verifier, or a plugin declared with
    :func:`relayrl.reward.api.runs_code`); scoring with a pure reward needs none."""

    def __init__(self, cfg: RewardConfig, code_token: str = "") -> None:
        self.cfg = cfg
        self.code_token = code_token
        self.spec = ScorerSpec.from_config(cfg)
        # import and check the functions here (before serving): a bad config fails start-up naming the field
        self.runs_code = Scorer(self.spec, sandbox=Sandbox(cfg.sandbox)).runs_code
        if self.runs_code and not code_token:
            log.warning(
                "the reward (%s) runs code and no code token is configured (control.code_token_env): every "
                "Score, ScoreBatch and POST /score is refused",
                self.spec.describe(),
            )
        self.header = StatusHeader("reward")
        self.pool = VerifierPool(
            self.spec,
            cfg.sandbox,
            cfg.workers,
            cfg.timeout_s,
            cfg.chunk_size,
            cfg.start_method,
            cfg.worker_memory_mb,
            on_restart=self._restarted,
        )
        self.metrics = RewardMetrics(self.pool)
        self.scored = 0
        self.errors = 0
        self.timeouts = 0

    def _restarted(self, reason: str) -> None:
        self.metrics.restarts.labels(reason).inc()

    async def start(self) -> None:
        await self.pool.start()
        self.header.state = ServingState.SERVING_STATE_SERVING

    async def close(self) -> None:
        self.header.state = ServingState.SERVING_STATE_STOPPED
        await self.pool.close()

    async def score(self, inputs: list[RewardInput], ids: list[str] | None = None) -> list[Outcome]:
        outcomes = await self.pool.score_many(inputs)
        for i, outcome in enumerate(outcomes):
            self.metrics.scores.labels(outcome.status.value).inc()
            if outcome.status is Status.OK:
                self.scored += 1
                self.metrics.seconds.observe(outcome.seconds)
                continue
            if outcome.status is Status.TIMEOUT:
                self.timeouts += 1
            else:
                self.errors += 1
            with log_context(episode_id=ids[i] if ids else None):
                log.warning("verifier %s (episode %s): %s", outcome.status.value, ids[i] if ids else "-", outcome.error)
        return outcomes

    @staticmethod
    def to_pb(episode_id: str, outcome: Outcome) -> pb.ScoreResponse:
        if outcome.status is not Status.OK or outcome.result is None:
            return pb.ScoreResponse(episode_id=episode_id, status=outcome.status.pb, error=outcome.error)
        r = outcome.result
        return pb.ScoreResponse(
            episode_id=episode_id,
            status=outcome.status.pb,
            score=r.score,
            components=dict(r.components),
            details=r.details,
        )

    @staticmethod
    def to_input(req: pb.ScoreRequest) -> RewardInput:
        return RewardInput(
            prompt=req.prompt,
            completion=req.completion,
            reference=req.reference,
            metadata=decode_metadata(req.metadata),
        )

    async def require_code_token(self, context: grpc.aio.ServicerContext) -> None:
        """A reward that runs code scores only for holders of the code token, checked before any work."""
        if self.runs_code:
            await require_token(context, self.code_token, SCORE_CALL)

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        await self.require_code_token(context)
        (outcome,) = await self.score([self.to_input(request)], [request.episode_id])
        return self.to_pb(request.episode_id, outcome)

    async def ScoreBatch(
        self, request: pb.ScoreBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreBatchResponse:
        await self.require_code_token(context)
        if len(request.requests) > self.cfg.max_batch:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"batch of {len(request.requests)} exceeds max_batch={self.cfg.max_batch}",
            )
        ids = [r.episode_id for r in request.requests]
        outcomes = await self.score([self.to_input(r) for r in request.requests], ids)
        return pb.ScoreBatchResponse(responses=[self.to_pb(i, o) for i, o in zip(ids, outcomes, strict=True)])

    async def RunCode(self, request: pb.RunCodeRequest, context: grpc.aio.ServicerContext) -> pb.RunCodeResponse:
        """One program in the verifier pool's sandbox (code_runs.py); code token first, then limits, then the run."""
        await require_token(context, self.code_token, "RunCode")
        try:
            return await self.run_code(request)
        except RefusedRun as exc:
            await context.abort(exc.code, str(exc))
            raise  # abort raises; this line is for the type checker

    async def run_code(self, request: pb.RunCodeRequest) -> pb.RunCodeResponse:
        """RunCode's work after the credential (gRPC and REST): RefusedRun when a limit is passed, else the run."""
        try:
            job = check_request(request, self.cfg)
        except RefusedRun:
            self.metrics.code_runs.labels("refused").inc()
            raise
        (outcome,) = await self.pool.score_many([job])
        response = to_response(outcome)
        self.metrics.code_runs.labels(status_label(response)).inc()
        if response.status == pb.CODE_RUN_STATUS_ERROR:
            log.warning("RunCode did not run: %s", response.error)
        return response

    async def GetStatus(self, request: pb.GetRewardStatusRequest, context: grpc.aio.ServicerContext) -> pb.RewardStatus:
        return pb.RewardStatus(
            component=self.header.message(),
            reward_function=self.spec.describe(),
            scored=self.scored,
            errors=self.errors,
            timeouts=self.timeouts,
            worker_restarts=sum(self.pool.restarts.values()),
            workers_ready=self.pool.ready_workers,
        )


def create_reward_server(
    cfg: RewardConfig, tls: TlsConfig | None = None, code_token: str = ""
) -> tuple[ServerHandle, RewardServicer]:
    """The gRPC server (TLS when ``tls`` is on) and its servicer; ``await servicer.start()`` starts the verifier
    workers. ``code_token``: what RunCode needs (control.code_token_env; empty: RunCode is refused), and scoring
    with a reward that runs code."""
    servicer = RewardServicer(cfg, code_token)
    name = pb.DESCRIPTOR.services_by_name["RewardService"].full_name
    handle = create_server(
        cfg.server,
        [lambda s: pb_grpc.add_RewardServiceServicer_to_server(servicer, s)],
        [name],
        tls,
        tokens={method_path(name, "RunCode"): code_token},
        section="reward.server",
    )
    return handle, servicer
