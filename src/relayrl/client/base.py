"""The base of relayrl's typed clients: :class:`RetryPolicy` and :class:`ServiceClient`, a channel to one service
with a deadline and a retry policy per method (the package docstring, relayrl.client, says which calls are retried
and why)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc

from relayrl.common.grpc_utils import channel
from relayrl.config.tls import TlsConfig

R = TypeVar("R")

log = logging.getLogger(__name__)

__all__ = ["NO_RETRY", "RetryPolicy", "ServiceClient"]


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
    """A channel to one service, with a default deadline and a retry policy per method; ``balanced`` clients
    spread their calls over the service's replicas (every address ``target`` resolves to)."""

    stub_class: Any = None
    # calls spread round robin over every address the target resolves to (replicas of a stateless service)
    balanced: bool = False

    def __init__(
        self,
        target: str,
        timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        token: str = "",
        policies: Mapping[str, RetryPolicy] | None = None,
        tls: TlsConfig | None = None,
        authenticate_all: bool = False,
    ) -> None:
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
        self.channel = channel(target, tls, self.balanced)
        self.stub = self.stub_class(self.channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def policy_for(self, rpc: str) -> RetryPolicy:
        """The retry policy of the RPC named ``rpc`` (``policies`` given to the client, else its default)."""
        return self.policies.get(rpc, self.policy)

    def _auth(self) -> tuple[tuple[str, str], ...] | None:
        """The bearer-token metadata of a mutating call (None without a token)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else None

    async def call(
        self,
        method: Callable[..., Awaitable[R]],
        request: Any,
        timeout_s: float | None = None,
        mutating: bool = False,
        policy: RetryPolicy | None = None,
    ) -> R:
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
                log.info(
                    "%s: %s (try %d of %d); retrying in %.1fs",
                    self.target,
                    exc.code().name,
                    failed,
                    policy.attempts,
                    delay,
                )
                await asyncio.sleep(delay)
