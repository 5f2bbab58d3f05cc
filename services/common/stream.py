"""The Redis stream that carries episode groups from rollout to the trainer.

Each stream entry holds one serialized :class:`EpisodeGroup` (the n samples of one prompt) under the field
``group`` (every key and field name: relayrl.common.redis_keys): a group is delivered, acknowledged and
normalised as a whole, so no consumer holds part of one. The trainer reads through a consumer group
(at-least-once delivery): entries stay pending until acknowledged, and it acknowledges only once a checkpoint
holding their effect is durable. The stream is never trimmed; backpressure comes from admission control, not
from deleting entries.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from relayrl.common.pb.episode_pb2 import EpisodeGroup
from relayrl.common.redis_conn import async_client
from relayrl.common.redis_keys import STREAM_FIELD, DropReason, RedisKeys
from relayrl.config.redis import RedisConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamEntry:
    entry_id: str
    group: EpisodeGroup


@dataclass(frozen=True)
class GroupInfo:
    """Consumer-group counters, in stream entries (groups)."""

    pending: int  # delivered to a consumer, not acknowledged
    lag: int  # not delivered yet
    length: int  # entries in the stream


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class EpisodeStream:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self.keys = keys
        self.stream = keys.stream
        self.group = keys.group

    @classmethod
    def from_config(cls, cfg: RedisConfig) -> EpisodeStream:
        """The run's stream (``redis.url``, its keys named by the ``redis`` section)."""
        return cls(async_client(cfg, decode_responses=False), RedisKeys.from_config(cfg))

    @classmethod
    def from_url(cls, url: str, stream: str, group: str) -> EpisodeStream:
        return cls.from_config(RedisConfig(url=url, stream=stream, group=group))

    @property
    def client(self) -> aioredis.Redis:
        return self._redis

    async def close(self) -> None:
        await self._redis.aclose()

    async def ensure_group(self) -> None:
        """Create the stream and its consumer group if absent (idempotent); a new group starts at 0."""
        try:
            await self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def append(self, group: EpisodeGroup, pipe: Any = None) -> None:
        """Append one group. With ``pipe`` (a MULTI pipeline), the XADD joins the caller's transaction."""
        if pipe is not None:
            pipe.xadd(self.stream, {STREAM_FIELD: group.SerializeToString()})
            return
        await self._redis.xadd(self.stream, {STREAM_FIELD: group.SerializeToString()})

    def _parse(self, items: Any) -> list[StreamEntry]:
        entries: list[StreamEntry] = []
        for entry_id, fields in items or []:
            if not fields or STREAM_FIELD not in fields:
                log.warning("stream entry %s has no episode group payload; skipping it", _text(entry_id))
                continue
            entries.append(StreamEntry(_text(entry_id), EpisodeGroup.FromString(fields[STREAM_FIELD])))
        return entries

    async def read(self, consumer: str, count: int, block_ms: int, pending_after: str | None = None
                   ) -> list[StreamEntry]:
        """Read up to ``count`` entries for ``consumer``: its own pending entries with ids after
        ``pending_after`` (``"0"`` for all), or, when it is None, new entries (id ``>``), blocking up to
        ``block_ms`` for them."""
        start: str = ">" if pending_after is None else pending_after
        reply: Any = await self._redis.xreadgroup(
            self.group, consumer, {self.stream: start}, count=count,
            block=block_ms if pending_after is None else None)
        return [e for _stream, items in reply or [] for e in self._parse(items)]

    async def ack(self, entry_ids: Sequence[str]) -> int:
        if not entry_ids:
            return 0
        return int(await self._redis.xack(self.stream, self.group, *entry_ids))

    async def claim_from_gone_consumers(self, consumer: str, live: set[str]) -> int:
        """Move the pending entries of consumers not in ``live`` (e.g. ranks of a larger earlier run) to
        ``consumer``. Returns how many entries were claimed."""
        claimed = 0
        for info in await self._redis.xinfo_consumers(self.stream, self.group):
            name = _text(info["name"])
            if name in live or int(info["pending"]) == 0:
                continue
            rows: Any = await self._redis.xpending_range(self.stream, self.group, min="-", max="+",
                                                         count=int(info["pending"]), consumername=name)
            ids: list[Any] = [_text(r["message_id"]) for r in rows]
            if ids:
                await self._redis.xclaim(self.stream, self.group, consumer, min_idle_time=0, message_ids=ids,
                                         justid=True)
                claimed += len(ids)
                log.info("claimed %d pending entries of gone consumer %s", len(ids), name)
        return claimed

    async def record_dropped(self, group_id: str, episodes: int, reason: DropReason = "stale") -> None:
        """Record a group dropped by the trainer, as too stale (``stale``) or because every episode of it failed
        scoring (``reward_error``). Idempotent: a group dropped again after a restart counts once."""
        await self._redis.hset(self.keys.dropped(reason), group_id, episodes)

    async def dropped(self, reason: DropReason = "stale") -> tuple[int, int]:
        """(groups, episodes) dropped for ``reason``, over every rank and restart."""
        values: Any = await self._redis.hvals(self.keys.dropped(reason))
        return len(values), sum(int(v) for v in values)

    async def _group_entry(self) -> dict[Any, Any] | None:
        """The consumer group's XINFO GROUPS entry; None before the stream or the group exists."""
        try:
            groups = await self._redis.xinfo_groups(self.stream)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return None  # nothing appended and no group created yet: an empty queue, not an error
            raise
        for g in groups:
            if _text(g["name"]) == self.group:
                return dict(g)
        return None

    async def queue_depth(self) -> tuple[int | None, int]:
        """(lag, pending) of this consumer group, from one XINFO GROUPS: entries not yet delivered to any
        consumer (None where Redis cannot tell) and entries delivered but not acknowledged."""
        g = await self._group_entry()
        if g is None:
            return None, 0
        lag = g.get("lag")
        return (int(lag) if lag is not None else None), int(g["pending"])

    async def info(self) -> GroupInfo:
        length = int(await self._redis.xlen(self.stream))
        g = await self._group_entry()
        if g is None:
            return GroupInfo(pending=0, lag=length, length=length)
        lag = g.get("lag")
        return GroupInfo(pending=int(g["pending"]), lag=int(lag) if lag is not None else -1, length=length)
