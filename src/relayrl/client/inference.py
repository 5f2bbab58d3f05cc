"""The inference service's client: generation, scoring under the served weights, and weight pushes
(UpdateWeights, with its own deadline and retries)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from relayrl.client.base import NO_RETRY, ServiceClient
from relayrl.common.grpc_admission import ADMITTED
from relayrl.common.pb import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["Generates", "InferenceClient", "generate_request"]


def generate_request(
    prompt: str | list[int] | list[dict[str, str]],
    sampling: inference_pb2.SamplingParams,
    request_id: str = "",
    suffix_text: str = "",
) -> inference_pb2.GenerateRequest:
    """A GenerateRequest for a text, token-id or conversation prompt (see InferenceClient.generate)."""
    if isinstance(prompt, str):
        request = inference_pb2.GenerateRequest(prompt_text=prompt, sampling=sampling)
    elif prompt and isinstance(prompt[0], dict):
        turns = [inference_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt if isinstance(m, dict)]
        request = inference_pb2.GenerateRequest(
            prompt_messages=inference_pb2.ChatMessages(messages=turns), sampling=sampling
        )
    else:
        ids = [i for i in prompt if isinstance(i, int)]
        request = inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=ids), sampling=sampling)
    request.request_id = request_id
    request.suffix_text = suffix_text
    return request


class Generates:
    """``generate`` for whatever sends GenerateRequests (``send_generate``): one client, a pool of replicas, a
    session pinned to one, rollout's joiner."""

    async def send_generate(
        self, request: inference_pb2.GenerateRequest, timeout_s: float = 120.0
    ) -> inference_pb2.GenerateResponse:
        raise NotImplementedError

    async def generate(
        self,
        prompt: str | list[int] | list[dict[str, str]],
        sampling: inference_pb2.SamplingParams,
        timeout_s: float = 120.0,
        request_id: str = "",
        suffix_text: str = "",
    ) -> inference_pb2.GenerateResponse:
        """``prompt``: text, token ids, or a conversation (``[{"role": ..., "content": ...}]``) that the server
        renders with the model's chat template. ``suffix_text``: text the server tokenizes and appends to the
        prompt (multi-turn: the new observation after the exact ids of the earlier turns)."""
        return await self.send_generate(generate_request(prompt, sampling, request_id, suffix_text), timeout_s)


class InferenceClient(Generates, ServiceClient):
    stub_class = inference_pb2_grpc.InferenceServiceStub

    async def status(self) -> inference_pb2.InferenceStatus:
        return await self.call(
            self.stub.GetStatus, inference_pb2.GetInferenceStatusRequest(), policy=self.policy_for("GetStatus")
        )

    async def send_generate(
        self, request: inference_pb2.GenerateRequest, timeout_s: float = 120.0
    ) -> inference_pb2.GenerateResponse:
        """Generate for a request built with :func:`generate_request`."""
        return await self.call(self.stub.Generate, request, timeout_s, policy=self.policy_for("Generate"))

    async def generate_batch(
        self, requests: Sequence[inference_pb2.GenerateRequest], timeout_s: float = 120.0
    ) -> inference_pb2.GenerateBatchResponse:
        """Several Generate requests (built with :func:`generate_request`) in one call: the responses in their
        order. A request Generate would refuse refuses the whole call (with Generate's code)."""
        return await self.call(
            self.stub.GenerateBatch,
            inference_pb2.GenerateBatchRequest(requests=requests),
            timeout_s,
            policy=self.policy_for("GenerateBatch"),
        )

    def generate_batch_stream(self, requests: Sequence[inference_pb2.GenerateRequest], timeout_s: float = 120.0) -> Any:
        """GenerateBatchStream: the call, an async iterator of GenerateBatchItem, each request's response as soon as
        its samples end. Not retried (answers may have arrived); its deadline bounds the whole call."""
        metadata = self._auth() if self.authenticate_all else None
        return self.stub.GenerateBatchStream(
            inference_pb2.GenerateBatchRequest(requests=requests), timeout=timeout_s, metadata=metadata
        )

    def generate_stream(
        self,
        prompt: str | list[int] | list[dict[str, str]],
        sampling: inference_pb2.SamplingParams,
        timeout_s: float = 120.0,
        request_id: str = "",
        suffix_text: str = "",
    ) -> Any:
        """GenerateStream (prompt as :meth:`generate`): the call, an async iterator of GenerateChunk whose deadline
        ``timeout_s`` bounds the whole stream. Not retried (a stream may have sent tokens); ``call.cancel()`` (or the
        deadline passing) cancels the request in the engine."""
        request = generate_request(prompt, sampling, request_id, suffix_text)
        return self.stub.GenerateStream(request, timeout=timeout_s)

    async def score(
        self,
        sequences: Sequence[tuple[Sequence[int], Sequence[int], float]],
        timeout_s: float = 120.0,
        request_id: str = "",
    ) -> inference_pb2.ScoreTokensResponse:
        """Logprobs of each (prompt ids, completion ids, temperature)'s completion tokens under the served weights."""
        request = inference_pb2.ScoreTokensRequest(
            request_id=request_id,
            sequences=[
                inference_pb2.ScoredSequence(prompt_token_ids=list(p), completion_token_ids=list(c), temperature=t)
                for p, c, t in sequences
            ],
        )
        return await self.call(self.stub.ScoreTokens, request, timeout_s, policy=self.policy_for("ScoreTokens"))

    async def update_weights(
        self,
        messages: Sequence[inference_pb2.WeightUpdateMessage],
        version: int,
        timeout_s: float,
        attempts: int | None = None,
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
                return await self._push_once(messages, deadline.try_timeout())
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code is grpc.StatusCode.RESOURCE_EXHAUSTED and (delay := deadline.next_delay()) is not None:
                    log.warning(
                        "%s: weight push of version %d refused (%s: %s); retrying in %.2fs (%.1fs left)",
                        self.target,
                        version,
                        code.name,
                        exc.details(),
                        delay,
                        deadline.left(),
                    )
                    _told(on_retry, code)
                    await asyncio.sleep(delay)
                    continue
                if code not in (*retryable, grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                if await self._serves(version, deadline):
                    return None
                if code not in retryable or attempt == attempts or (delay := deadline.next_delay()) is None:
                    raise
                log.warning(
                    "%s: weight push of version %d failed (%s; try %d); retrying in %.2fs (%.1fs left)",
                    self.target,
                    version,
                    code.name,
                    attempt,
                    delay,
                    deadline.left(),
                )
                _told(on_retry, code)
                await asyncio.sleep(delay)
                attempt += 1

    async def _push_once(
        self, messages: Sequence[inference_pb2.WeightUpdateMessage], timeout_s: float
    ) -> inference_pb2.UpdateWeightsResponse:
        """One try of a push. Its messages are streamed only once the server has admitted the call (its initial
        metadata carries ADMITTED): a refusal at admission (RESOURCE_EXHAUSTED, UNAUTHENTICATED, PERMISSION_DENIED)
        then reaches the caller with its own code, where a write racing the refusal would turn it into INTERNAL
        (grpc/grpc#36066). A call not admitted is half-closed with nothing written. The server reads what is left
        of a stream it refuses later, so such a refusal keeps its code too."""
        admitted = asyncio.get_running_loop().create_future()

        async def stream() -> AsyncIterator[inference_pb2.WeightUpdateMessage]:
            if await admitted:
                async for message in _update_stream(messages):
                    yield message

        call = self.stub.UpdateWeights(stream(), timeout=timeout_s, metadata=self._auth())
        try:
            admitted.set_result((await call.initial_metadata()).get(ADMITTED[0]) == ADMITTED[1])
        finally:
            if not admitted.done():
                admitted.set_result(False)
        response: inference_pb2.UpdateWeightsResponse = await call
        return response

    async def _serves(self, version: int, deadline: _PushDeadline) -> bool:
        """Whether inference serves ``version`` now (False when it cannot tell), asked once within what is left of
        the push's deadline (at least a second: a push that landed at its deadline is still recognised). Asked with
        the client's credential (when it has one): on the weights port the call counts in the budget of
        authenticated calls, which callers without the weights token cannot fill."""
        try:
            status = await self.call(
                self.stub.GetStatus,
                inference_pb2.GetInferenceStatusRequest(),
                timeout_s=min(max(deadline.left(), 1.0), self.timeout_s),
                mutating=True,
                policy=NO_RETRY,
            )
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
        delay = min(self.backoff_s * 2**self.retries, self.MAX_DELAY_S)
        if self.left() - delay <= 0:
            return None
        self.retries += 1
        return delay


def _told(on_retry: Callable[[grpc.StatusCode], None] | None, code: grpc.StatusCode) -> None:
    if on_retry is not None:
        on_retry(code)


async def _update_stream(
    messages: Sequence[inference_pb2.WeightUpdateMessage],
) -> AsyncIterator[inference_pb2.WeightUpdateMessage]:
    """The UpdateWeights request messages. Messages already in memory are taken on the event loop; a sequence that
    reads each chunk from a file when asked (``reads_file``, a sharded gather's spool) is read in a worker thread,
    one chunk at a time, so the loop never waits for the disk."""
    in_thread = getattr(messages, "reads_file", False)
    for index in range(len(messages)):
        yield await asyncio.to_thread(messages.__getitem__, index) if in_thread else messages[index]
