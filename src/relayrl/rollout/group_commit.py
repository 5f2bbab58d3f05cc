"""Rollout's records in Redis by group commit: each group's XADD with the record of its prompt seq (or the record
of a skipped seq) in one MULTI, retried through an outage or a full Redis for ``redis.retry_s``.

Records queue, and whoever holds the lock next writes every queued record in one transaction (in queue order: the
recorded watermark follows the order in which they execute), so groups that finish together cost one round trip.
A transaction that fails for another reason fails its caller's record only; the others go back to the head of the
queue, and the next holder of the lock (one of their callers) writes them. A transaction that Redis did not take
within ``redis.retry_s`` (unreachable, or full) fails every waiting record at once with :class:`AppendFailed`, and
every later one: one outage costs one ``redis.retry_s``, not one per group, and the rollout loop stops. A
transaction whose reply was lost may be applied twice: the trainer never trains a group id twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from relayrl.common.pb import episode_pb2
from relayrl.common.retry import TRANSIENT, redis_retry
from relayrl.common.stream import EpisodeStream
from relayrl.rollout.progress import Progress, ProgressStore

log = logging.getLogger(__name__)

Record = tuple[int, episode_pb2.EpisodeGroup | None, asyncio.Future[None]]  # (seq, group or None: a skip, done)


class AppendFailed(RuntimeError):
    """Redis took no append within ``redis.retry_s`` (unreachable or full): rollout stops; the groups not recorded
    are generated again when it restarts (relayrl.rollout.progress)."""


class GroupCommit:
    def __init__(
        self, stream: EpisodeStream, retry_s: float, on_oom: Callable[[], None], after_try: Callable[[], None]
    ) -> None:
        self.stream = stream
        self.retry_s = retry_s
        self.store = ProgressStore(stream.client, stream.keys)
        self.progress = Progress()
        self.committed = 0  # Redis transactions that appended groups or recorded skips
        self.failure: AppendFailed | None = None  # set once: no record is written after it
        self._on_oom = on_oom  # a full Redis refused a transaction (it is retried)
        self._after_try = after_try  # a transaction went through or gave up
        self._lock = asyncio.Lock()
        self._records: list[Record] = []

    async def load(self) -> Progress:
        """The progress recorded in Redis (a restarted rollout continues from it)."""
        self.progress = await self.store.load()
        return self.progress

    async def record(self, seq: int, group: episode_pb2.EpisodeGroup | None) -> None:
        """Write ``group`` (None: ``seq`` skipped) and the record of ``seq``; returns once applied."""
        if self.failure is not None:
            raise self.failure
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._records.append((seq, group, done))
        async with self._lock:
            if not done.done():  # not yet written by an earlier holder of the lock
                batch, self._records = self._records, []
                try:
                    await self._commit(batch)
                except (*TRANSIENT, RedisError) as exc:  # past redis.retry_s: every waiting record fails with it
                    waiting, self._records = [*batch, *self._records], []
                    self._fail(waiting, exc)
                except BaseException:  # nothing of the batch is known applied: the others are written by their
                    self._records[:0] = [r for r in batch if r[2] is not done]  # own callers, next, in order
                    raise
        await done

    async def _commit(self, batch: list[Record]) -> None:
        """One MULTI for ``batch``; then the records count as applied and their callers are released."""

        async def attempt() -> None:
            planned = Progress(self.progress.watermark, set(self.progress.done))  # each seq planned after the last
            async with self.stream.client.pipeline(transaction=True) as pipe:
                for seq, group, _ in batch:
                    if group is not None:
                        await self.stream.append(group, pipe)
                    self.store.queue(pipe, planned, seq, appended=group is not None)
                    planned.mark(seq)
                await pipe.execute()

        try:
            await redis_retry(attempt, "append group", self.retry_s, on_oom=self._on_oom)
        finally:
            self._after_try()
        self.committed += 1
        for seq, group, done in batch:
            self.store.applied(self.progress, seq, appended=group is not None)
            if not done.done():
                done.set_result(None)

    def _fail(self, records: list[Record], exc: BaseException) -> None:
        if self.failure is None:
            self.failure = AppendFailed(
                f"rollout stops: redis took no append within redis.retry_s = "
                f"{self.retry_s:g}s ({type(exc).__name__}: {exc}); the groups not recorded "
                "are generated again when it restarts"
            )
            self.failure.__cause__ = exc
            log.error("%s", self.failure)
        for _, _, done in records:
            if not done.done():
                done.set_exception(self.failure)
