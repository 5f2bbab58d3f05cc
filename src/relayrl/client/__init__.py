"""Typed Python clients of relayrl's services: what the CLI uses and how services call one another.

Every call has a deadline (per attempt: ``timeout_s`` of the call, else the client's) and a retry policy
(:class:`RetryPolicy`) chosen per method. By default only UNAVAILABLE (the server was not reached, or is
restarting) is retried, with exponential back-off; DEADLINE_EXCEEDED never is (the budget is spent and the server
may still be working on the call). Retrying is safe for every unary method relayrl has; the handlers show why:

- GetStatus, GetConfig: read-only. (WatchStatus, a stream, is read-only too; its caller re-subscribes.)
- Generate: no server-side state; a repeated call only samples again, and the caller uses one reply (its
  samples carry the weight versions that produced them, so an answer from either attempt is as good).
- GenerateBatch: several Generates in one call, each as above.
- ScoreTokens (inference): read-only, like Generate without sampling.
- Score, ScoreBatch: verifiers are pure functions of the request; only the service's counters see a repeat.
- Pause, Resume, RequestCheckpoint: set a state (paused or not, a checkpoint after the next step), so a repeat
  has the same effect as one call.

A client's default policy comes from ``retries`` and ``backoff_s``; ``policies`` overrides it per RPC name
(``{"Generate": RetryPolicy(attempts=3)}``, ``{"GetStatus": NO_RETRY}``). Mutating control calls send the
bearer token (``authorization`` metadata) when one is given (every call, with ``authenticate_all``: the server
then admits them in its budget of calls with a credential). With ``tls`` (the run config's ``tls`` section) the
channel is TLS, verifying the server against its CA and presenting its client certificate (mutual TLS).

    async with TrainerClient("localhost:50054", token="...") as trainer:
        status = await trainer.status()
        await trainer.request_checkpoint("before the upgrade")
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc

from relayrl.common.grpc_utils import channel
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
from relayrl.config.tls import TlsConfig

R = TypeVar("R")

log = logging.getLogger(__name__)

__all__ = ["NO_RETRY", "InferenceClient", "RetryPolicy", "RewardClient", "RolloutClient", "ServiceClient",
           "TrainerClient"]


@dataclass(frozen=True)
class RetryPolicy:
    """Up to ``attempts`` tries in all, repeated only after a status code in ``retry_on``, sleeping
    ``backoff_s * 2**(n - 1)`` (at most ``max_backoff_s``) after the n-th failed try."""

    attempts: int = 4
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    retry_on: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("a retry policy needs at least one attempt")

    def delay(self, failed: int) -> float:
        """Seconds to wait after the ``failed``-th failed try (1-based)."""
        return float(min(self.backoff_s * 2 ** (failed - 1), self.max_backoff_s))

    def retries(self, exc: grpc.aio.AioRpcError, failed: int) -> bool:
        return exc.code() in self.retry_on and failed < self.attempts


NO_RETRY = RetryPolicy(attempts=1)


class ServiceClient:
    """A channel to one service, with a default deadline and a retry policy per method."""

    stub_class: Any = None

    def __init__(self, target: str, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.2,
                 token: str = "", policies: Mapping[str, RetryPolicy] | None = None,
                 tls: TlsConfig | None = None, authenticate_all: bool = False) -> None:
        self.target = target
        # send the token on read-only calls too: the server then counts them in its budget of authenticated calls,
        # which callers without a credential cannot fill (relayrl.common.grpc_admission)
        self.authenticate_all = authenticate_all
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.token = token
        self.policy = RetryPolicy(attempts=retries + 1, backoff_s=backoff_s)
        self.policies = dict(policies or {})
        self.channel = channel(target, tls)
        self.stub = self.stub_class(self.channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def policy_for(self, rpc: str) -> RetryPolicy:
        """The retry policy of the RPC named ``rpc`` (``policies`` given to the client, else its default)."""
        return self.policies.get(rpc, self.policy)

    def _auth(self) -> tuple[tuple[str, str], ...] | None:
        """The bearer-token metadata of a mutating call (None without a token)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else None

    async def call(self, method: Callable[..., Awaitable[R]], request: Any, timeout_s: float | None = None,
                   mutating: bool = False, policy: RetryPolicy | None = None) -> R:
        """One call: each try with the deadline ``timeout_s`` (else the client's), retried by ``policy``
        (else the client's default)."""
        policy = policy or self.policy
        metadata = self._auth() if mutating or self.authenticate_all else None
        failed = 0
        while True:
            try:
                return await method(request, timeout=timeout_s or self.timeout_s, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                failed += 1
                if not policy.retries(exc, failed):
                    raise
                delay = policy.delay(failed)
                log.info("%s: %s (try %d of %d); retrying in %.1fs", self.target, exc.code().name, failed,
                         policy.attempts, delay)
                await asyncio.sleep(delay)


def generate_request(prompt: str | list[int] | list[dict[str, str]], sampling: inference_pb2.SamplingParams,
                     request_id: str = "", suffix_text: str = "") -> inference_pb2.GenerateRequest:
    """A GenerateRequest for a text, token-id or conversation prompt (see InferenceClient.generate)."""
    if isinstance(prompt, str):
        request = inference_pb2.GenerateRequest(prompt_text=prompt, sampling=sampling)
    elif prompt and isinstance(prompt[0], dict):
        turns = [inference_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt if isinstance(m, dict)]
        request = inference_pb2.GenerateRequest(prompt_messages=inference_pb2.ChatMessages(messages=turns),
                                                sampling=sampling)
    else:
        ids = [i for i in prompt if isinstance(i, int)]
        request = inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=ids), sampling=sampling)
    request.request_id = request_id
    request.suffix_text = suffix_text
    return request


class InferenceClient(ServiceClient):
    stub_class = inference_pb2_grpc.InferenceServiceStub

    async def status(self) -> inference_pb2.InferenceStatus:
        return await self.call(self.stub.GetStatus, inference_pb2.GetInferenceStatusRequest(),
                               policy=self.policy_for("GetStatus"))

    async def generate(self, prompt: str | list[int] | list[dict[str, str]], sampling: inference_pb2.SamplingParams,
                       timeout_s: float = 120.0, request_id: str = "",
                       suffix_text: str = "") -> inference_pb2.GenerateResponse:
        """``prompt``: text, token ids, or a conversation (``[{"role": ..., "content": ...}]``) that the server
        renders with the model's chat template. ``suffix_text``: text the server tokenizes and appends to the
        prompt (multi-turn: the new observation after the exact ids of the earlier turns)."""
        return await self.send_generate(generate_request(prompt, sampling, request_id, suffix_text), timeout_s)

    async def send_generate(self, request: inference_pb2.GenerateRequest,
                            timeout_s: float = 120.0) -> inference_pb2.GenerateResponse:
        """Generate for a request built with :func:`generate_request`."""
        return await self.call(self.stub.Generate, request, timeout_s, policy=self.policy_for("Generate"))

    async def generate_batch(self, requests: Sequence[inference_pb2.GenerateRequest],
                             timeout_s: float = 120.0) -> inference_pb2.GenerateBatchResponse:
        """Several Generate requests (built with :func:`generate_request`) in one call: the responses in their
        order. A request Generate would refuse refuses the whole call (with Generate's code)."""
        return await self.call(self.stub.GenerateBatch, inference_pb2.GenerateBatchRequest(requests=requests),
                               timeout_s, policy=self.policy_for("GenerateBatch"))

    def generate_stream(self, prompt: str | list[int] | list[dict[str, str]], sampling: inference_pb2.SamplingParams,
                        timeout_s: float = 120.0, request_id: str = "", suffix_text: str = "") -> Any:
        """GenerateStream (prompt as :meth:`generate`): the call, an async iterator of GenerateChunk whose deadline
        ``timeout_s`` bounds the whole stream. Not retried (a stream may have sent tokens); ``call.cancel()`` (or the
        deadline passing) cancels the request in the engine."""
        request = generate_request(prompt, sampling, request_id, suffix_text)
        return self.stub.GenerateStream(request, timeout=timeout_s)

    async def score(self, sequences: Sequence[tuple[Sequence[int], Sequence[int], float]], timeout_s: float = 120.0,
                    request_id: str = "") -> inference_pb2.ScoreTokensResponse:
        """Logprobs of each (prompt ids, completion ids, temperature)'s completion tokens under the served weights."""
        request = inference_pb2.ScoreTokensRequest(request_id=request_id, sequences=[
            inference_pb2.ScoredSequence(prompt_token_ids=list(p), completion_token_ids=list(c), temperature=t)
            for p, c, t in sequences])
        return await self.call(self.stub.ScoreTokens, request, timeout_s, policy=self.policy_for("ScoreTokens"))

    async def update_weights(self, messages: Sequence[inference_pb2.WeightUpdateMessage], version: int,
                             timeout_s: float, attempts: int | None = None,
                             on_retry: Callable[[grpc.StatusCode], None] | None = None,
                             ) -> inference_pb2.UpdateWeightsResponse | None:
        """Push one weight update (its chunks, then the manifest, on the UpdateWeights client stream) within
        ``timeout_s``: the deadline of the whole push, its retries and checks included.

        A try that timed out (DEADLINE_EXCEEDED) or met UNAVAILABLE may still have been applied, so before
        retrying it asks the served version (one try): when inference serves ``version`` the push landed and this
        returns None (applied; its answer, with the probe logprobs, was lost). A retry refused as stale
        (FAILED_PRECONDITION) because ``version`` is served reads the same. A try refused with RESOURCE_EXHAUSTED
        (a budget of the weights server full: nothing was received) or that met UNAVAILABLE or DEADLINE_EXCEEDED
        (inference restarting) is sent again with exponential back-off while the next try still starts within
        the deadline, at most ``attempts`` tries of the latter kind (None: as many as the deadline allows).
        ``on_retry`` is told the code of each retried failure. Any other failure, or the last try's, raises
        grpc.aio.AioRpcError."""
        retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        deadline = _PushDeadline(timeout_s, self.backoff_s)
        attempt = 1
        while True:
            try:
                response: inference_pb2.UpdateWeightsResponse = await self.stub.UpdateWeights(
                    _update_stream(messages), timeout=deadline.try_timeout(), metadata=self._auth())
                return response
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code is grpc.StatusCode.RESOURCE_EXHAUSTED and (delay := deadline.next_delay()) is not None:
                    log.warning("%s: weight push of version %d refused (%s: %s); retrying in %.2fs (%.1fs left)",
                                self.target, version, code.name, exc.details(), delay, deadline.left())
                    _told(on_retry, code)
                    await asyncio.sleep(delay)
                    continue
                if code not in (*retryable, grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                if await self._serves(version, deadline):
                    return None
                if code not in retryable or attempt == attempts or (delay := deadline.next_delay()) is None:
                    raise
                log.warning("%s: weight push of version %d failed (%s; try %d); retrying in %.2fs (%.1fs left)",
                            self.target, version, code.name, attempt, delay, deadline.left())
                _told(on_retry, code)
                await asyncio.sleep(delay)
                attempt += 1

    async def _serves(self, version: int, deadline: _PushDeadline) -> bool:
        """Whether inference serves ``version`` now (False when it cannot tell), asked once within what is left of
        the push's deadline (at least a second: a push that landed at its deadline is still recognised). Asked with
        the client's credential (when it has one): on the weights port the call counts in the budget of
        authenticated calls, which callers without the weights token cannot fill."""
        try:
            status = await self.call(self.stub.GetStatus, inference_pb2.GetInferenceStatusRequest(),
                                     timeout_s=min(max(deadline.left(), 1.0), self.timeout_s), mutating=True,
                                     policy=NO_RETRY)
            return int(status.weight_version) == version
        except grpc.aio.AioRpcError:
            return False


class _PushDeadline:
    """One push's deadline, ``timeout_s`` after it starts: each try gets what is left of it, and a failed try
    may be sent again after an exponential back-off from ``backoff_s`` (at most 2 s) while the next try still
    starts before the deadline."""

    MAX_DELAY_S = 2.0

    def __init__(self, timeout_s: float, backoff_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.backoff_s = max(backoff_s, 0.01)
        self.retries = 0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def try_timeout(self) -> float:
        return max(self.left(), 0.001)

    def next_delay(self) -> float | None:
        delay = min(self.backoff_s * 2 ** self.retries, self.MAX_DELAY_S)
        if self.left() - delay <= 0:
            return None
        self.retries += 1
        return delay


def _told(on_retry: Callable[[grpc.StatusCode], None] | None, code: grpc.StatusCode) -> None:
    if on_retry is not None:
        on_retry(code)


def _update_stream(messages: Sequence[inference_pb2.WeightUpdateMessage],
                   ) -> Iterator[inference_pb2.WeightUpdateMessage] | AsyncIterator[inference_pb2.WeightUpdateMessage]:
    """The UpdateWeights request stream. grpc.aio consumes a plain iterator on the event loop, which is right for
    messages already in memory; a sequence that reads each chunk from a file when asked (``reads_file``, a sharded
    gather's spool) is read in a worker thread, one chunk at a time, so the loop never waits for the disk."""
    if not getattr(messages, "reads_file", False):
        return iter(messages)

    async def read() -> AsyncIterator[inference_pb2.WeightUpdateMessage]:
        for index in range(len(messages)):
            yield await asyncio.to_thread(messages.__getitem__, index)
    return read()


class RewardClient(ServiceClient):
    stub_class = reward_pb2_grpc.RewardServiceStub

    async def status(self) -> reward_pb2.RewardStatus:
        return await self.call(self.stub.GetStatus, reward_pb2.GetRewardStatusRequest(),
                               policy=self.policy_for("GetStatus"))

    # Score and ScoreBatch send the client's token (the code token) when it has one: a reward that runs code (the
    # code verifier) scores only for its holders; a pure reward ignores it.
    async def score(self, request: reward_pb2.ScoreRequest, timeout_s: float = 60.0) -> reward_pb2.ScoreResponse:
        return await self.call(self.stub.Score, request, timeout_s, mutating=True, policy=self.policy_for("Score"))

    async def score_batch(self, requests: Sequence[reward_pb2.ScoreRequest],
                          timeout_s: float = 60.0) -> reward_pb2.ScoreBatchResponse:
        """Score several episodes in one call; the responses come in the order of ``requests``."""
        return await self.call(self.stub.ScoreBatch, reward_pb2.ScoreBatchRequest(requests=requests), timeout_s,
                               mutating=True, policy=self.policy_for("ScoreBatch"))

    async def run_code(self, code: str, stdin: bytes = b"", timeout_s: float = 10.0, run_timeout_s: float = 0.0,
                       memory_mb: int = 0) -> reward_pb2.RunCodeResponse:
        """Run one Python program in the reward service's code sandbox (needs the client's ``token``: the code
        token). ``timeout_s`` is the call's deadline; ``run_timeout_s`` and ``memory_mb`` the run's own limits
        (0: the service's; more than it allows is RESOURCE_EXHAUSTED)."""
        request = reward_pb2.RunCodeRequest(code=code, stdin=stdin, timeout_s=run_timeout_s, memory_mb=memory_mb)
        return await self.call(self.stub.RunCode, request, timeout_s, mutating=True, policy=self.policy_for("RunCode"))


class RolloutClient(ServiceClient):
    stub_class = rollout_pb2_grpc.RolloutServiceStub

    async def status(self) -> rollout_pb2.RolloutStatus:
        return await self.call(self.stub.GetStatus, rollout_pb2.GetRolloutStatusRequest(),
                               policy=self.policy_for("GetStatus"))

    async def pause(self, reason: str = "") -> rollout_pb2.RolloutStatus:
        return await self.call(self.stub.Pause, rollout_pb2.PauseRequest(reason=reason), mutating=True,
                               policy=self.policy_for("Pause"))

    async def resume(self) -> rollout_pb2.RolloutStatus:
        return await self.call(self.stub.Resume, rollout_pb2.ResumeRequest(), mutating=True,
                               policy=self.policy_for("Resume"))

    async def config(self) -> str:
        return (await self.call(self.stub.GetConfig, common_pb2.GetConfigRequest(),
                                 policy=self.policy_for("GetConfig"))).yaml


class TrainerClient(ServiceClient):
    stub_class = trainer_pb2_grpc.TrainerServiceStub

    async def status(self) -> trainer_pb2.TrainerStatus:
        return await self.call(self.stub.GetStatus, trainer_pb2.GetTrainerStatusRequest(),
                               policy=self.policy_for("GetStatus"))

    async def watch_status(self, timeout_s: float) -> AsyncIterator[trainer_pb2.TrainerStatus]:
        """The trainer's status now and at each change, until the run finishes or ``timeout_s`` (the stream's
        deadline: DEADLINE_EXCEEDED then, and the caller subscribes again). Not retried: the caller decides."""
        call = self.stub.WatchStatus(trainer_pb2.WatchTrainerStatusRequest(), timeout=timeout_s,
                                     metadata=self._auth() if self.authenticate_all else None)
        try:
            async for status in call:
                yield status
        finally:
            call.cancel()

    async def request_checkpoint(self, reason: str = "") -> trainer_pb2.CheckpointReply:
        return await self.call(self.stub.RequestCheckpoint, trainer_pb2.CheckpointRequest(reason=reason),
                               mutating=True, policy=self.policy_for("RequestCheckpoint"))

    async def config(self) -> str:
        return (await self.call(self.stub.GetConfig, common_pb2.GetConfigRequest(),
                                 policy=self.policy_for("GetConfig"))).yaml
