"""Admission of gRPC calls: the credential first, then a slot in one of separate budgets.

grpc's own ``maximum_concurrent_rpcs`` counts every call (health, reflection, calls that never send their request)
before anything checks a credential, so callers without one could fill it and starve the callers that hold one (a
trainer's weight push, a checkpoint request). :class:`Admission`, the first interceptor of every server
(relayrl.common.grpc_utils.create_server), admits instead:

1. A method that needs a credential (``tokens``: full method name -> the token it needs, or a function that reads
   the service's token when a call comes, given by the service) is
   refused at once without one: UNAUTHENTICATED for a missing or wrong ``authorization: Bearer <token>``,
   PERMISSION_DENIED when the service has none configured. Nothing is counted for a refused call. (The handlers
   keep their own check, relayrl.common.control.require_token: defence in depth.)
2. An admitted call takes a slot for its whole duration (released when it ends, errors and cancellation
   included) in exactly one budget of the server's section (relayrl.config.endpoints.ServerConfig):
   - ``max_authenticated_rpcs``: calls with a valid credential of this service (a method that needs one, or any
     other method called with one of the service's tokens). Callers without a credential never take it;
   - ``max_unauthenticated_rpcs``: unary calls without a credential;
   - ``max_streams``: streaming calls without a credential (health Watch, WatchStatus, reflection, GenerateStream,
     any request or response stream), all peers together; of them at most ``max_streams_per_peer`` from one peer
     host (``context.peer()`` without its port). Local callers all share the loopback host, so on loopback the
     per-peer cap bounds them together; it tells remote hosts apart.
   Over a budget: RESOURCE_EXHAUSTED at once, naming the budget's config field.

So that a call counts from the moment it opens, not from when its request arrives, every method is served as a
request-streaming handler (the wire is the same for both shapes): the slot is taken before the request is read, so
a call that never sends its request holds a slot in its budget (until its deadline), never in another.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import unquote

import grpc

from relayrl.common.control import authorized
from relayrl.config.endpoints import ServerConfig

Token = str | Callable[[], str]  # a method's token, or what reads it when a call comes

# Initial metadata a client-streaming handler sends once it has admitted the call (credential, port, budget all
# checked), before it reads the stream. A client that waits for it writes nothing to a call the server refuses:
# grpc.aio reports a write that meets an ended call as INTERNAL and hides the server's status
# (grpc/grpc#36066), so a refusal must come before the first write. Sent by UpdateWeights.
ADMITTED = ("relayrl-admitted", "1")


class Budget(Enum):
    """Which budget an admitted call counts in (the value: its config field)."""

    AUTHENTICATED = "max_authenticated_rpcs"
    UNARY = "max_unauthenticated_rpcs"
    STREAM = "max_streams"


@dataclass
class AdmissionState:
    """The calls each budget holds now, the unauthenticated streams per peer host, and the refusals so far (by the
    budget field, or ``UNAUTHENTICATED`` / ``PERMISSION_DENIED``)."""

    active: Counter[Budget] = field(default_factory=Counter)
    streams_by_peer: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)


def peer_host(peer: str) -> str:
    """The host part of ``context.peer()`` (``ipv4:127.0.0.1:5000`` -> ``127.0.0.1``, ``ipv6:[::1]:5000`` -> ``::1``);
    any other form (``unix:...``) is its own peer."""
    kind, _, rest = unquote(peer or "").partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer or "unknown"


def _authorization(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


class Admission(grpc.aio.ServerInterceptor):
    """Server interceptor (the first): credential check, then a slot in the call's budget (see the module)."""

    def __init__(self, cfg: ServerConfig, tokens: Mapping[str, Token] | None = None, section: str = "server") -> None:
        self.cfg = cfg
        self.tokens = dict(tokens or {})
        self.section = section
        self.state = AdmissionState()
        self.limits = {
            Budget.AUTHENTICATED: cfg.max_authenticated_rpcs,
            Budget.UNARY: cfg.max_unauthenticated_rpcs,
            Budget.STREAM: cfg.max_streams,
        }

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED, answered by grpc at once
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        streaming = handler.request_streaming or handler.response_streaming
        return _wrap(handler, lambda context: self._admit(method, streaming, context))

    def _token(self, method: str) -> str:
        token = self.tokens[method]
        return token() if callable(token) else token

    def _refuse_credential(self, method: str, header: str | None) -> tuple[grpc.StatusCode, str] | None:
        if method not in self.tokens:
            return None
        token = self._token(method)
        if not token:
            self.state.refused["PERMISSION_DENIED"] += 1
            return grpc.StatusCode.PERMISSION_DENIED, f"{method} is disabled: the service has no credential configured"
        if not authorized(header, token):
            self.state.refused["UNAUTHENTICATED"] += 1
            return grpc.StatusCode.UNAUTHENTICATED, f"{method} needs authorization: Bearer <token>"
        return None

    def _budget(self, method: str, header: str | None, streaming: bool) -> Budget:
        if method in self.tokens:
            return Budget.AUTHENTICATED  # its credential was checked
        if header is not None and any(authorized(header, self._token(m)) for m in self.tokens):
            return Budget.AUTHENTICATED  # any credential of the service, on a method open to all
        return Budget.STREAM if streaming else Budget.UNARY

    def _over(self, budget: Budget, host: str) -> str | None:
        """The refusal message when ``budget`` (or the peer's share of the streams) is full, else None."""
        limit = self.limits[budget]
        if self.state.active[budget] >= limit:
            self.state.refused[budget.value] += 1
            return (
                f"the server is at its limit of {limit} {_NOUNS[budget]} ({self.section}.{budget.value}); "
                "try again later"
            )
        per_peer = self.cfg.max_streams_per_peer
        if budget is Budget.STREAM and self.state.streams_by_peer[host] >= per_peer:
            self.state.refused["max_streams_per_peer"] += 1
            return (
                f"{host} already holds {per_peer} streams without a credential "
                f"({self.section}.max_streams_per_peer); try again later"
            )
        return None

    @contextmanager
    def _slot(self, budget: Budget, host: str) -> Iterator[None]:
        state = self.state
        state.active[budget] += 1
        if budget is Budget.STREAM:
            state.streams_by_peer[host] += 1
        try:
            yield
        finally:
            state.active[budget] -= 1
            if budget is Budget.STREAM:
                state.streams_by_peer[host] -= 1
                if state.streams_by_peer[host] <= 0:
                    del state.streams_by_peer[host]

    async def _admit(self, method: str, streaming: bool, context: grpc.aio.ServicerContext) -> Any:
        """Check the call's credential and take its slot: the slot's context manager (abort on a refusal)."""
        header = _authorization(context.invocation_metadata())
        refusal = self._refuse_credential(method, header)
        if refusal is not None:
            await context.abort(*refusal)
        budget = self._budget(method, header, streaming)
        host = peer_host(context.peer())
        over = self._over(budget, host)
        if over is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, over)
        return self._slot(budget, host)


_NOUNS = {
    Budget.AUTHENTICATED: "calls with a credential",
    Budget.UNARY: "calls without a credential",
    Budget.STREAM: "streams without a credential",
}

Admit = Callable[[grpc.aio.ServicerContext], Awaitable[Any]]


def _wrap(h: Any, admit: Admit) -> Any:
    """``h`` re-served as a request-streaming handler whose behaviour is admitted first."""
    kwargs = {"request_deserializer": h.request_deserializer, "response_serializer": h.response_serializer}
    if h.unary_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_unary_unary(h.unary_unary, admit), **kwargs)
    if h.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_stream_unary(h.stream_unary, admit), **kwargs)
    if h.unary_stream is not None:
        return grpc.stream_stream_rpc_method_handler(_streamed(h.unary_stream, admit, True), **kwargs)
    return grpc.stream_stream_rpc_method_handler(_streamed(h.stream_stream, admit, False), **kwargs)


async def _one(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
    """The request of a unary-request method, read from the stream it now arrives on."""
    async for request in requests:
        return request
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message")


def _unary_unary(behavior: Any, admit: Admit) -> Any:
    async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        with await admit(context):
            return await behavior(await _one(requests, context), context)

    return call


def _stream_unary(behavior: Any, admit: Admit) -> Any:
    async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        with await admit(context):
            return await behavior(requests, context)

    return call


def _streamed(behavior: Any, admit: Admit, unary_request: bool) -> Any:
    """A response-streaming method as one coroutine that writes each response: the slot is released when the
    coroutine ends (an async generator left at a ``yield`` by a cancelled call would hold it until collected)."""
    generator = inspect.isasyncgenfunction(behavior)

    async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        with await admit(context):
            request = await _one(requests, context) if unary_request else requests
            if not generator:  # a coroutine that writes with context.write (health Watch)
                await behavior(request, context)
                return
            responses = behavior(request, context)
            try:
                async for response in responses:
                    await context.write(response)
            finally:
                await responses.aclose()

    return call


def method_path(service: str, method: str) -> str:
    """The full name grpc gives a method (``/relayrl.v1.TrainerService/RequestCheckpoint``): a ``tokens`` key."""
    return f"/{service}/{method}"
