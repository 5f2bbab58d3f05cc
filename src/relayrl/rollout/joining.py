"""One call for the concurrent groups of rollout: a per-call cost paid once per batch, not once per group.

Groups run concurrently, and each makes one Generate and one ScoreBatch call (relayrl.rollout.workflows). Each call
costs a gRPC round trip, a handler and (for ScoreBatch) a hand-off to reward's verifier workers whatever its size,
and on a small model that per-call cost is most of the work. :class:`CallJoiner` joins calls of one kind: a call made
while ``max_in_flight`` others are on the wire waits for one of them, then goes out with every other call that
arrived meanwhile, as one request (at most ``max_items`` items). The first call of a quiet moment goes out at once,
after the other groups woken in the same event-loop turn have joined it, so joining adds no latency when there is
nothing to join. Joined generation goes out as GenerateBatchStream, which answers each caller as soon as its own
samples end (an inference without it: GenerateBatch, answered when its longest sample ends), so the groups of short
answers are scored and appended while the engine finishes the rest; ``rollout.generate_calls_in_flight`` sets how
many joined calls each replica may have on the wire.

Each caller gets exactly its own result. A joined call that fails fails every caller in it, as each would have
failed alone (both RPCs are idempotent and retried by the client's policy); its deadline is the shortest of its
callers'. A caller cancelled while waiting is left out of the next call; one cancelled while its call is on the wire
leaves the call to finish for the others.

:class:`JoinedScorer` and :class:`JoinedInference` stand where the workflows' reward and inference clients stood
(``WorkflowContext``): ``score_batch`` joins into one ScoreBatch, ``generate`` into one GenerateBatch (inference
refuses a whole batch for one bad request: then each request of it is sent alone, so that only its own caller
fails). Every other attribute (``run_code``, ``generate_stream``, ...) is the wrapped client's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc

from relayrl.client.inference import Generates
from relayrl.common.pb import inference_pb2, reward_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# GenerateBatch answers these for one request it refuses (or, UNIMPLEMENTED, an inference without it): each request
# then goes alone, so that only its own caller fails
_SEND_ALONE = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED)


Deliver = Callable[[int, R], None]  # hands item i's result to its caller before the call's end (a streamed answer)


@dataclass
class _Caller(Generic[T, R]):
    item: T
    timeout_s: float
    future: asyncio.Future[R] = field(repr=False)


class CallJoiner(Generic[T, R]):
    """Joins concurrent ``call(item)`` into ``send(items, timeout_s)``, which returns one result (or exception) per
    item, in order, with at most ``max_in_flight`` sends at once. ``size`` weighs an item against ``max_items`` (1
    each by default); ``max_callers``, when set, also bounds the items of one call."""

    def __init__(
        self,
        send: Callable[[list[T], float, Deliver[R]], Awaitable[list[R | BaseException]]],
        max_items: int,
        size: Callable[[T], int] = lambda _: 1,
        max_callers: int | None = None,
        max_in_flight: int = 1,
    ) -> None:
        for name, value in (("max_items", max_items), ("max_in_flight", max_in_flight)):
            if value < 1:
                raise ValueError(f"{name} {value} must be >= 1")
        self.send, self.max_items, self.size, self.max_callers = send, max_items, size, max_callers
        self.max_in_flight = max_in_flight
        self._waiting: list[_Caller[T, R]] = []
        self._senders: set[asyncio.Task[None]] = set()  # each sends until nothing waits
        self.calls = 0  # calls sent
        self.callers = 0  # calls they carried

    async def call(self, item: T, timeout_s: float) -> R:
        caller: _Caller[T, R] = _Caller(item, timeout_s, asyncio.get_running_loop().create_future())
        self._waiting.append(caller)
        if len(self._senders) < self.max_in_flight:
            sender = asyncio.create_task(self._send_all(), name="joined-call")
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)  # also a sender cancelled before it ran (no finally)
        return await caller.future

    def _take(self) -> list[_Caller[T, R]]:
        """The next call's callers: waiting ones in arrival order while they fit in ``max_items`` (the first always
        goes, whatever its size: the server refuses it as it would alone)."""
        taken: list[_Caller[T, R]] = []
        items = 0
        while self._waiting:
            caller = self._waiting[0]
            if caller.future.done():  # cancelled while it waited
                self._waiting.pop(0)
                continue
            if taken and (
                items + self.size(caller.item) > self.max_items
                or (self.max_callers is not None and len(taken) >= self.max_callers)
            ):
                break
            taken.append(self._waiting.pop(0))
            items += self.size(caller.item)
        return taken

    async def _send_all(self) -> None:
        try:
            await asyncio.sleep(0)  # the groups woken in this loop turn join the first call
            while taken := self._take():
                await self._send(taken)
        finally:  # at once, not by the task's done callback: a caller its last answer woke may call again before that
            self._senders.discard(asyncio.current_task())

    async def _send(self, taken: list[_Caller[T, R]]) -> None:
        def deliver(i: int, result: R) -> None:  # an answer that arrived before the call's others
            if not taken[i].future.done():
                taken[i].future.set_result(result)

        try:
            results = await self.send([c.item for c in taken], min(c.timeout_s for c in taken), deliver)
        except asyncio.CancelledError:  # rollout is stopping: nobody waits for the rest
            for c in [*taken, *self._waiting]:
                c.future.cancel()
            self._waiting.clear()
            raise
        except Exception as exc:  # the call failed: each caller fails as it would have alone
            results = [exc] * len(taken)
        if len(results) != len(taken):  # a server that answered another count: nobody's answer can be trusted
            results = [RuntimeError(f"{len(results)} answers for {len(taken)} joined calls")] * len(taken)
        self.calls += 1
        self.callers += len(taken)
        for c, result in zip(taken, results, strict=True):
            if c.future.done():
                continue
            if isinstance(result, BaseException):
                c.future.set_exception(result)
            else:
                c.future.set_result(result)


class JoinedScorer:
    """``score_batch`` of ``client`` (a relayrl.client.RewardClient), joined into one ScoreBatch of at most
    ``max_items`` requests across concurrent callers."""

    def __init__(self, client: Any, max_items: int) -> None:
        self.client = client
        self.joiner: CallJoiner[list[reward_pb2.ScoreRequest], reward_pb2.ScoreBatchResponse] = CallJoiner(
            self._send, max_items, len
        )

    def __getattr__(self, name: str) -> Any:  # run_code, status, close, ...: the wrapped client's
        return getattr(self.client, name)

    async def score_batch(
        self, requests: Sequence[reward_pb2.ScoreRequest], timeout_s: float = 60.0
    ) -> reward_pb2.ScoreBatchResponse:
        """Score ``requests`` (responses in their order), in one call with whatever else is waiting."""
        if not requests:
            return reward_pb2.ScoreBatchResponse()
        return await self.joiner.call(list(requests), timeout_s)

    async def _send(
        self, items: list[list[reward_pb2.ScoreRequest]], timeout_s: float, deliver: Deliver[Any]
    ) -> list[reward_pb2.ScoreBatchResponse | BaseException]:
        requests = [r for item in items for r in item]
        got = list((await self.client.score_batch(requests, timeout_s=timeout_s)).responses)
        if len(got) != len(requests):  # each caller's workflow refuses a short answer (GroupFailed)
            log.warning(
                "reward returned %d scores for %d requests of %d joined calls", len(got), len(requests), len(items)
            )
            return [reward_pb2.ScoreBatchResponse() for _ in items]
        out: list[reward_pb2.ScoreBatchResponse | BaseException] = []
        start = 0
        for item in items:
            out.append(reward_pb2.ScoreBatchResponse(responses=got[start : start + len(item)]))
            start += len(item)
        return out


class JoinedInference(Generates):
    """``generate`` of ``client`` (a relayrl.client.InferenceClient), joined into one GenerateBatch of at most
    ``max_requests`` requests across concurrent callers and, when ``max_samples`` is given, at most that many samples
    (their n summed: inference refuses a GenerateBatch over its inference.max_samples_per_request), with at most
    ``max_in_flight`` GenerateBatch calls on the wire."""

    def __init__(self, client: Any, max_requests: int, max_samples: int | None = None, max_in_flight: int = 1) -> None:
        self.client = client
        self.batching = True  # False once inference answered UNIMPLEMENTED (a version without GenerateBatch)
        self.streaming = True  # False once inference answered UNIMPLEMENTED to GenerateBatchStream
        self.joiner: CallJoiner[inference_pb2.GenerateRequest, inference_pb2.GenerateResponse] = (
            CallJoiner(self._send, max_requests, max_in_flight=max_in_flight)
            if max_samples is None
            else CallJoiner(
                self._send, max_samples, lambda r: max(1, r.sampling.n), max_requests, max_in_flight=max_in_flight
            )
        )

    def __getattr__(self, name: str) -> Any:  # generate_stream, score, status, close, ...: the wrapped client's
        return getattr(self.client, name)

    async def send_generate(
        self, request: inference_pb2.GenerateRequest, timeout_s: float = 120.0
    ) -> inference_pb2.GenerateResponse:
        """As InferenceClient.send_generate, in one call with whatever else is waiting."""
        return await self.joiner.call(request, timeout_s)

    async def _send(
        self,
        requests: list[inference_pb2.GenerateRequest],
        timeout_s: float,
        deliver: Deliver[inference_pb2.GenerateResponse],
    ) -> list[inference_pb2.GenerateResponse | BaseException]:
        if len(requests) > 1 and self.batching:
            try:
                if self.streaming:
                    return await self._stream(requests, timeout_s, deliver)
                resp = await self.client.generate_batch(requests, timeout_s=timeout_s)
                return list(resp.responses)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED and self.streaming:
                    self.streaming = False  # an inference without GenerateBatchStream: its GenerateBatch
                    return await self._send(requests, timeout_s, deliver)
                if exc.code() not in _SEND_ALONE:
                    raise
                self.batching = exc.code() != grpc.StatusCode.UNIMPLEMENTED
        return list(
            await asyncio.gather(*(self.client.send_generate(r, timeout_s) for r in requests), return_exceptions=True)
        )

    async def _stream(
        self,
        requests: list[inference_pb2.GenerateRequest],
        timeout_s: float,
        deliver: Deliver[inference_pb2.GenerateResponse],
    ) -> list[inference_pb2.GenerateResponse | BaseException]:
        """GenerateBatchStream: each caller gets its response as soon as it arrives. A call that fails fails the
        callers not answered yet with its error, as a failed GenerateBatch fails all (UNAVAILABLE: a pool generates
        theirs again on another replica); those answered keep their answers."""
        out: list[inference_pb2.GenerateResponse | BaseException] = [
            RuntimeError("GenerateBatchStream ended without this request's answer")
        ] * len(requests)
        call = self.client.generate_batch_stream(requests, timeout_s)
        try:
            async for item in call:
                out[item.index] = item.response
                deliver(item.index, item.response)
        finally:
            call.cancel()
        return out
