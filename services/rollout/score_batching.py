"""One ScoreBatch call for the concurrent groups of rollout: a per-call cost paid once per batch, not per group.

Groups run concurrently and each scores its samples with one ``ScoreBatch`` (relayrl.rollout.workflows). Each
call costs a gRPC round trip and a hand-off to reward's verifier workers whatever its size, and on a small model
that per-call cost is most of reward's work. :class:`CoalescingScorer` stands where the workflows' reward client
stood (``WorkflowContext.reward``): a ``score_batch`` made while another is on the wire waits for it and then
goes out with every other call that arrived meanwhile, as one request (at most ``max_items`` items, reward's
``max_batch``). The first call of a quiet moment goes out at once, after the other groups woken in the same
event-loop turn have joined it, so coalescing adds no latency when there is nothing to join.

Each caller gets exactly its own responses, in its order. A call that fails fails every caller in it, as each
would have failed alone (ScoreBatch is idempotent and retried by the client's policy); the deadline of a joined
call is the shortest of its callers'. A caller cancelled while waiting is left out of the next call; one
cancelled while its call is on the wire leaves the call to finish for the others. Every other attribute (such
as ``run_code``) is the wrapped client's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.common.pb import reward_pb2

log = logging.getLogger(__name__)


@dataclass
class _Caller:
    requests: list[reward_pb2.ScoreRequest]
    timeout_s: float
    future: asyncio.Future[reward_pb2.ScoreBatchResponse] = field(repr=False)


class CoalescingScorer:
    """``score_batch`` of ``client`` (a relayrl.client.RewardClient), joined across concurrent callers."""

    def __init__(self, client: Any, max_items: int) -> None:
        if max_items < 1:
            raise ValueError(f"max_items {max_items} must be >= 1")
        self.client = client
        self.max_items = max_items
        self._waiting: list[_Caller] = []
        self._sender: asyncio.Task[None] | None = None
        self.calls = 0  # ScoreBatch calls made
        self.callers = 0  # score_batch calls served by them

    def __getattr__(self, name: str) -> Any:  # run_code, status, close, ...: the wrapped client's
        return getattr(self.client, name)

    async def score_batch(self, requests: Sequence[reward_pb2.ScoreRequest],
                          timeout_s: float = 60.0) -> reward_pb2.ScoreBatchResponse:
        """Score ``requests`` (responses in their order), in one call with whatever else is waiting."""
        if not requests:
            return reward_pb2.ScoreBatchResponse()
        caller = _Caller(list(requests), timeout_s, asyncio.get_running_loop().create_future())
        self._waiting.append(caller)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_all(), name="coalesced-score-batch")
        return await caller.future

    def _take(self) -> list[_Caller]:
        """The next call's callers: waiting ones in arrival order while they fit in ``max_items`` (the first always
        goes, whatever its size: reward answers a call beyond its limit with RESOURCE_EXHAUSTED, as alone)."""
        taken: list[_Caller] = []
        items = 0
        while self._waiting:
            caller = self._waiting[0]
            if caller.future.done():  # cancelled while it waited
                self._waiting.pop(0)
                continue
            if taken and items + len(caller.requests) > self.max_items:
                break
            taken.append(self._waiting.pop(0))
            items += len(caller.requests)
        return taken

    async def _send_all(self) -> None:
        await asyncio.sleep(0)  # the groups woken in this loop turn join the first call
        while taken := self._take():
            await self._send(taken)

    async def _send(self, taken: list[_Caller]) -> None:
        requests = [r for c in taken for r in c.requests]
        try:
            resp = await self.client.score_batch(requests, timeout_s=min(c.timeout_s for c in taken))
        except asyncio.CancelledError:  # rollout is stopping: nobody waits for the rest
            for c in [*taken, *self._waiting]:
                c.future.cancel()
            self._waiting.clear()
            raise
        except Exception as exc:  # the RPC failed: each caller fails as it would have alone
            for c in taken:
                if not c.future.done():
                    c.future.set_exception(exc)
            return
        self.calls += 1
        self.callers += len(taken)
        got = list(resp.responses)
        if len(got) != len(requests):  # the callers' workflows refuse a short answer (GroupFailed), each its own
            log.warning("reward returned %d scores for %d requests of %d joined calls", len(got), len(requests),
                        len(taken))
        start = 0
        for c in taken:
            part = got[start:start + len(c.requests)] if len(got) == len(requests) else []
            start += len(c.requests)
            if not c.future.done():
                c.future.set_result(reward_pb2.ScoreBatchResponse(responses=part))
