"""Rollout progress in Redis, written in the same transaction as each group: resume without loss or repeats.

Every admitted prompt gets a sequence number ``seq`` (its position in the dataset's epoch-by-epoch order).
With each group's XADD, the same MULTI/EXEC records ``seq`` as done, so a group is in the stream if and only
if its prompt is recorded. State: ``watermark`` (every seq below it is done), the set of done seqs at or
above it, and counters. After a restart rollout regenerates exactly the prompts that were admitted but not
recorded (in flight at the crash) and continues after the highest recorded one: no prompt is skipped, and
none is appended twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from relayrl.common.redis_keys import PROGRESS_APPENDED, PROGRESS_SKIPPED, PROGRESS_WATERMARK, RedisKeys


@dataclass
class Progress:
    watermark: int = 0
    done: set[int] = field(default_factory=set)
    appended: int = 0  # groups appended to the stream
    skipped: int = 0  # prompts given up after repeated failures (recorded as done, never appended)

    def next_seq(self) -> int:
        return max(self.done, default=self.watermark - 1) + 1

    def missing(self) -> list[int]:
        """Seqs admitted before a restart but never recorded: they must be generated again."""
        return [s for s in range(self.watermark, self.next_seq()) if s not in self.done]

    def plan(self, seq: int) -> tuple[list[int], int]:
        """What marking ``seq`` done would do, without doing it: (seqs that fall below the watermark, the new
        watermark)."""
        done = self.done | {seq}
        removed, watermark = [], self.watermark
        while watermark in done:
            removed.append(watermark)
            watermark += 1
        return removed, watermark

    def mark(self, seq: int) -> list[int]:
        """Record ``seq`` as done; returns the seqs that fell below the advanced watermark."""
        removed, self.watermark = self.plan(seq)
        self.done = (self.done | {seq}) - set(removed)
        return removed


class ProgressStore:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self.hash_key = keys.rollout_progress
        self.set_key = keys.rollout_done

    async def load(self) -> Progress:
        raw: Any = await self._redis.hgetall(self.hash_key)
        values = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
        done: Any = await self._redis.smembers(self.set_key)
        return Progress(
            watermark=values.get(PROGRESS_WATERMARK, 0),
            done={int(x) for x in done},
            appended=values.get(PROGRESS_APPENDED, 0),
            skipped=values.get(PROGRESS_SKIPPED, 0),
        )

    def queue(self, pipe: Any, progress: Progress, seq: int, appended: bool) -> None:
        """Queue the commands that record ``seq`` into ``pipe`` (the caller's MULTI); ``progress`` is unchanged
        until :meth:`applied` (the transaction may fail and be retried)."""
        below, watermark = progress.plan(seq)
        pipe.sadd(self.set_key, seq)
        if below:
            pipe.srem(self.set_key, *below)
        pipe.hset(self.hash_key, PROGRESS_WATERMARK, watermark)
        pipe.hincrby(self.hash_key, PROGRESS_APPENDED if appended else PROGRESS_SKIPPED, 1)

    @staticmethod
    def applied(progress: Progress, seq: int, appended: bool) -> None:
        progress.mark(seq)
        if appended:
            progress.appended += 1
        else:
            progress.skipped += 1
