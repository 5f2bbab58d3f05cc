"""A pool of inference replicas behind the calls rollout's workflows make (``generate``, ``send_generate``,
``generate_batch``, ``generate_stream``, ``status``): :class:`InferencePool`.

- **Routing.** Each call goes to the routable replica with the least work in flight (samples requested), so a slow
  replica, which holds its work longer, gets less.
- **Failover.** A replica that fails a call with UNAVAILABLE (connection refused, gone) or DEADLINE_EXCEEDED leaves
  routing at once; the call is generated again on another replica and counted (``regenerated``). Nothing of the
  failed attempt is used: its answer never arrived. Each answer's tokens carry the versions of the replica that
  made them.
- **Sessions.** :func:`pinned` gives a multi-turn episode or an agent session its own view of the pool: every call
  goes to the replica of its first call, which holds the conversation's prefix in its cache, while that replica is
  routable and not behind; then to another, which it keeps (``sessions_moved``).
- **Health.** A background check asks every replica for its status each ``check_every_s``. A routable replica
  that cannot be reached (UNAVAILABLE), or that serves an older version than it did before (it restarted: versions
  never go back), leaves routing too, so no call waits on a dead replica and a restarted one never generates with
  its start-up weights.
- **Readmission.** A replica out of routing comes back when it answers SERVING with a weight version no older than
  the oldest a routable replica serves (a restarted replica gets the current weights from the trainer's watchdog
  first).

With no routable replica, a call waits for one to come back, up to its own deadline, then fails UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import grpc

from relayrl.client.base import NO_RETRY, RetryPolicy
from relayrl.client.inference import Generates, InferenceClient
from relayrl.common.pb import inference_pb2, rollout_pb2
from relayrl.common.pb.common_pb2 import ServingState
from relayrl.config.tls import TlsConfig

log = logging.getLogger(__name__)

R = TypeVar("R")

__all__ = [
    "FAILOVER_CODES",
    "Inference",
    "InferencePool",
    "PoolUnavailable",
    "Replica",
    "connect_inference",
    "pinned",
    "replica_counts",
]

# a replica that answers these is gone or stuck: out of routing, the call generated again elsewhere
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
CHECK_TIMEOUT_S = 2.0
_GONE = -1  # the check's answer for a replica that cannot be reached (versions start at 0)


class PoolUnavailable(grpc.aio.AioRpcError):
    """No replica could take the call within its deadline (UNAVAILABLE, as one unreachable server would be)."""

    def __init__(self, details: str) -> None:
        empty = grpc.aio.Metadata()
        super().__init__(grpc.StatusCode.UNAVAILABLE, empty, empty, details)


@dataclass
class Replica:
    """One inference replica: its client and what the pool knows of it."""

    address: str
    client: InferenceClient
    caller: Any = None  # what generation calls go through: the client, or a wrapper of it (join_calls)
    in_flight: int = 0  # samples requested by calls in flight
    routable: bool = True  # False once it failed a call, until the readmission check
    behind: bool = False  # the trainer says its last weight push failed (TrainerStatus.inference_replicas_behind)
    version: int = -1  # the weight version it served at the last check (-1: not asked yet)


@dataclass
class InferencePool(Generates):
    """Rollout's inference, spread over ``addresses`` (the module docstring says how). A generation call is not
    retried on its replica: another replica takes it at once."""

    addresses: Sequence[str]
    tls: TlsConfig | None = None
    check_every_s: float = 1.0
    regenerated: int = 0  # calls generated again on another replica after one failed them
    sessions_moved: int = 0  # pinned sessions that continued on another replica (theirs left routing)
    replicas: list[Replica] = field(init=False)

    def __post_init__(self) -> None:
        if not self.addresses:
            raise ValueError("an inference pool needs at least one replica")
        policies = {"Generate": NO_RETRY, "GenerateBatch": NO_RETRY, "GetStatus": NO_RETRY}  # the check asks again
        self.replicas = [Replica(a, InferenceClient(a, policies=policies, tls=self.tls)) for a in self.addresses]
        for replica in self.replicas:
            replica.caller = replica.client
        self._changed = asyncio.Event()  # a replica came back (readmitted, or no longer behind)
        self._checker: asyncio.Task[None] | None = None

    def join_calls(self, wrap: Callable[[InferenceClient], Any]) -> None:
        """Send each replica's generation calls through ``wrap(client)`` (rollout's joiner: concurrent groups' calls
        to one replica joined into one GenerateBatch, each replica with its own joined call on the wire)."""
        for replica in self.replicas:
            replica.caller = wrap(replica.client)

    # --- the calls the workflows make -----------------------------------------------------------------------------
    async def status(self) -> inference_pb2.InferenceStatus:
        """The status of the least loaded routable replica."""
        return await self._route(lambda caller: caller.status(), 0, 10.0)

    async def send_generate(
        self, request: inference_pb2.GenerateRequest, timeout_s: float = 120.0, pin: Pin | None = None
    ) -> inference_pb2.GenerateResponse:
        """One request on the least loaded replica, or ``pin``'s (through its joiner when calls are joined)."""
        return await self._route(
            lambda caller: caller.send_generate(request, timeout_s), _samples(request), timeout_s, pin
        )

    async def generate_batch(
        self, requests: Sequence[inference_pb2.GenerateRequest], timeout_s: float = 120.0
    ) -> inference_pb2.GenerateBatchResponse:
        work = sum(_samples(r) for r in requests)
        return await self._route(lambda caller: caller.generate_batch(requests, timeout_s), work, timeout_s)

    def generate_stream(
        self,
        prompt: str | list[int] | list[dict[str, str]],
        sampling: inference_pb2.SamplingParams,
        timeout_s: float = 120.0,
        request_id: str = "",
        suffix_text: str = "",
    ) -> Any:
        """A stream on the least loaded routable replica (a stream may have sent tokens: never failed over)."""
        return self.stream_on(self._pick(set()), prompt, sampling, timeout_s, request_id, suffix_text)

    def stream_on(self, replica: Replica | None, *args: Any) -> Any:
        return (replica or self.replicas[0]).client.generate_stream(*args)

    # --- routing --------------------------------------------------------------------------------------------------
    def _pick(self, tried: set[str], pin: Pin | None = None) -> Replica | None:
        """``pin``'s replica while it is routable and current; else the least loaded routable replica not ``tried``,
        not behind on weights (unless every one is)."""
        mine = pin.replica if pin is not None else None
        if mine is not None and mine.routable and not mine.behind and mine.address not in tried:
            return mine
        candidates = [r for r in self.replicas if r.routable and r.address not in tried]
        current = [r for r in candidates if not r.behind] or candidates
        return min(current, key=lambda r: r.in_flight, default=None)

    def set_behind(self, addresses: Sequence[str]) -> None:
        """The replicas the trainer says missed their last weight push (the others are current again)."""
        behind = set(addresses)
        for replica in self.replicas:
            if replica.behind and replica.address not in behind:
                self._changed.set()
            replica.behind = replica.address in behind

    async def _route(
        self, call: Callable[[Any], Awaitable[R]], work: int, timeout_s: float, pin: Pin | None = None
    ) -> R:
        self._ensure_checker()
        deadline = time.monotonic() + timeout_s
        tried: set[str] = set()
        while True:
            replica = self._pick(tried, pin) or await self._wait_for_replica(deadline)
            replica.in_flight += work
            try:
                answer = await call(replica.caller)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in FAILOVER_CODES:
                    raise
                self._evict(replica, exc.code().name)
                tried.add(replica.address)
                self.regenerated += 1
                continue
            finally:
                replica.in_flight -= work
            if pin is not None:
                self.sessions_moved += pin.replica not in (None, replica)
                pin.replica = replica
            return answer

    async def _wait_for_replica(self, deadline: float) -> Replica:
        """A routable replica (the first to come back), waiting up to ``deadline``; PoolUnavailable after it."""
        while (replica := self._pick(set())) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PoolUnavailable(f"no inference replica is routable ({', '.join(self.addresses)})")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=left)
        return replica

    def _evict(self, replica: Replica, why: str) -> None:
        if replica.routable:
            replica.routable = False
            log.warning("inference replica %s out of routing (%s); its calls go to the others", replica.address, why)

    # --- readmission ----------------------------------------------------------------------------------------------
    def _ensure_checker(self) -> None:
        """Start the readmission check with the first call (the pool is built outside any event loop)."""
        if self._checker is None:
            self._checker = asyncio.create_task(self._check_forever())

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.check_every_s)
            await self.check()

    async def check(self) -> None:
        """Ask every replica for its status: routable ones that are gone or restarted leave routing, the others
        come back when they serve a version no older than the oldest a routable replica serves."""
        answers = await asyncio.gather(*(self._ask(r) for r in self.replicas))
        for replica, version in zip(self.replicas, answers, strict=True):
            if version == _GONE:
                self._evict(replica, "unreachable")
            elif version is not None and version < replica.version:
                self._evict(replica, f"serves version {version} after {replica.version}: restarted")
        served = [(r, v) for r, v in zip(self.replicas, answers, strict=True) if isinstance(v, int) and v >= 0]
        floor = min((v for r, v in served if r.routable), default=0)
        readmitted = False
        for replica, version in served:
            replica.version = version
            if not replica.routable and version >= floor:
                replica.routable = readmitted = True
                log.info("inference replica %s back in routing (serves version %d)", replica.address, version)
        if readmitted:
            self._changed.set()

    async def _ask(self, replica: Replica) -> int | None:
        """The version ``replica`` serves; None when it is not SERVING or does not answer in time, _GONE when it
        cannot be reached."""
        try:
            status = await asyncio.wait_for(replica.client.status(), CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return _GONE if exc.code() == grpc.StatusCode.UNAVAILABLE else None
        except TimeoutError:
            return None
        if status.component.state != ServingState.SERVING_STATE_SERVING:
            return None
        return int(status.weight_version)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            await asyncio.gather(self._checker, return_exceptions=True)
        await asyncio.gather(*(r.client.close() for r in self.replicas))


@dataclass
class Pin:
    """The replica a session's calls go to (None until its first call is answered)."""

    replica: Replica | None = None


class PinnedInference(Generates):
    """A multi-turn episode's or agent session's view of a pool (the calls a workflow makes): each call on the
    session's replica while it is routable and current, failing over like any call."""

    def __init__(self, pool: InferencePool) -> None:
        self.pool, self.pin = pool, Pin()

    async def status(self) -> inference_pb2.InferenceStatus:
        return await self.pool.status()

    async def send_generate(
        self, request: inference_pb2.GenerateRequest, timeout_s: float = 120.0
    ) -> inference_pb2.GenerateResponse:
        return await self.pool.send_generate(request, timeout_s, self.pin)

    def generate_stream(self, *args: Any) -> Any:
        """A stream on the session's replica (or the least loaded, which becomes the session's)."""
        replica = self.pool._pick(set(), self.pin)
        if replica is not None:
            self.pin.replica = replica
        return self.pool.stream_on(replica, *args)


def pinned(inference: Any) -> Any:
    """``inference`` for one session: a :class:`PinnedInference` of a pool; anything else as it is (one replica)."""
    return PinnedInference(inference) if isinstance(inference, InferencePool) else inference


def _samples(request: inference_pb2.GenerateRequest) -> int:
    return max(int(request.sampling.n), 1)


Inference = InferenceClient | InferencePool  # what generates: one replica's client, or a pool of several


def connect_inference(
    addresses: Sequence[str], tls: TlsConfig | None = None, policies: Mapping[str, RetryPolicy] | None = None
) -> Inference:
    """The client of the inference replicas at ``addresses``: a plain client of the one, or a pool of several
    (``policies`` apply to the one client's calls; a pool fails over instead of retrying a replica)."""
    if len(addresses) == 1:
        return InferenceClient(addresses[0], policies=policies, tls=tls)
    return InferencePool(addresses, tls)


def replica_counts(inference: Inference) -> dict[str, Any]:
    """RolloutStatus's replica fields: calls generated again elsewhere, replicas routed to now, replicas, and each
    replica's state (one client: 0, 1, 1, none)."""
    if not isinstance(inference, InferencePool):
        return {"generations_regenerated": 0, "inference_replicas_routable": 1, "inference_replicas": 1}
    return {
        "generations_regenerated": inference.regenerated,
        "inference_replicas_routable": sum(r.routable and not r.behind for r in inference.replicas),
        "inference_replicas": len(inference.replicas),
        "inference_replica_states": [
            rollout_pb2.InferenceReplica(
                address=r.address,
                routable=r.routable,
                behind=r.behind,
                samples_in_flight=max(r.in_flight, 0),
                weight_version=r.version,
            )
            for r in inference.replicas
        ],
    }
