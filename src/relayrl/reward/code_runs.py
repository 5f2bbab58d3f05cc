"""RunCode: one program run for a rollout tool, in the verifier pool's sandbox (the ``code`` verifier's).

The request is checked against its limits before anything runs (code and stdin size, wall time, memory: over one,
RESOURCE_EXHAUSTED at once; a malformed value, INVALID_ARGUMENT). The program then runs as a job of the verifier
pool: in a verifier process, through its :class:`~relayrl.reward.sandbox.Sandbox` (bubblewrap by default), never in
the service's own process, with the pool's timeout as a backstop behind the sandbox's own wall-clock kill.
"""

from __future__ import annotations

import math

import grpc

from relayrl.common.pb import reward_pb2 as pb
from relayrl.config.reward import RewardConfig
from relayrl.reward.protocol import CodeRun, Outcome, Status

MIN_MEMORY_MB = 64  # reward.sandbox.memory_mb's own lower bound


class RefusedRun(ValueError):
    """A RunCode request outside its limits: ``code`` is the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_request(request: pb.RunCodeRequest, cfg: RewardConfig) -> CodeRun:
    """The job of a request within its limits, or RefusedRun saying which limit it passes."""
    limits, exhausted = cfg.code_runs, grpc.StatusCode.RESOURCE_EXHAUSTED
    size = len(request.code.encode())
    if size > limits.max_code_bytes:
        raise RefusedRun(
            exhausted, f"code of {size} bytes exceeds reward.code_runs.max_code_bytes={limits.max_code_bytes}"
        )
    if len(request.stdin) > limits.max_stdin_bytes:
        raise RefusedRun(
            exhausted,
            f"stdin of {len(request.stdin)} bytes exceeds reward.code_runs.max_stdin_bytes={limits.max_stdin_bytes}",
        )
    if not math.isfinite(request.timeout_s) or request.timeout_s < 0:
        raise RefusedRun(
            grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be >= 0 (0: the default), got {request.timeout_s}"
        )
    if request.timeout_s > limits.wall_timeout_s:
        raise RefusedRun(
            exhausted,
            f"timeout_s={request.timeout_s:g} exceeds reward.code_runs.wall_timeout_s={limits.wall_timeout_s:g}",
        )
    if request.memory_mb > cfg.sandbox.memory_mb:
        raise RefusedRun(
            exhausted, f"memory_mb={request.memory_mb} exceeds reward.sandbox.memory_mb={cfg.sandbox.memory_mb}"
        )
    if 0 < request.memory_mb < MIN_MEMORY_MB:
        raise RefusedRun(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"memory_mb must be 0 (the default) or >= {MIN_MEMORY_MB}, got {request.memory_mb}",
        )
    return CodeRun(
        code=request.code,
        stdin=bytes(request.stdin),
        wall_timeout_s=request.timeout_s or limits.wall_timeout_s,
        memory_mb=request.memory_mb or cfg.sandbox.memory_mb,
    )


def to_response(outcome: Outcome) -> pb.RunCodeResponse:
    """The answer to RunCode: how the program ran, or why it did not (the pool's timeout or error)."""
    ran = outcome.ran
    if outcome.status is Status.TIMEOUT:
        return pb.RunCodeResponse(status=pb.CODE_RUN_STATUS_TIMEOUT, error=outcome.error, wall_s=outcome.seconds)
    if outcome.status is not Status.OK or ran is None:
        return pb.RunCodeResponse(
            status=pb.CODE_RUN_STATUS_ERROR, error=outcome.error or "the program did not run", wall_s=outcome.seconds
        )
    if ran.timed_out:
        status = pb.CODE_RUN_STATUS_TIMEOUT
    elif ran.output_exceeded:
        status = pb.CODE_RUN_STATUS_OUTPUT_EXCEEDED
    else:
        status = pb.CODE_RUN_STATUS_EXITED
    return pb.RunCodeResponse(
        status=status,
        exit_code=ran.exit_code or 0,
        stdout=ran.stdout,
        stderr=ran.stderr,
        wall_s=ran.wall_s,
        error="" if status == pb.CODE_RUN_STATUS_EXITED else ran.describe(),
    )


def status_label(response: pb.RunCodeResponse) -> str:
    """The metrics label of a response: exited, timeout, output_exceeded or error."""
    return pb.CodeRunStatus.Name(response.status).removeprefix("CODE_RUN_STATUS_").lower()
