"""The Redis stream that carries episodes from rollout to the trainer.

Each stream entry holds one serialized :class:`Episode` under the field ``ep``. Rollout appends the n
episodes of one group in one MULTI/EXEC transaction, so a group's entries are contiguous. The trainer
reads through a consumer group (at-least-once delivery): entries stay pending until acknowledged.
The stream is never trimmed; backpressure comes from admission control, not from deleting entries.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from relayrl.common.pb.episode_pb2 import Episode

log = logging.getLogger(__name__)

FIELD = b"ep"


@dataclass(frozen=True)
class StreamEntry:
    entry_id: str
    episode: Episode


@dataclass(frozen=True)
class GroupInfo:
    """Consumer-group counters: entries delivered but not acknowledged, and entries not yet delivered."""

    pending: int
    lag: int
    length: int


class EpisodeStream:
    def __init__(self, client: aioredis.Redis, stream: str, group: str) -> None:
        self._redis = client
        self.stream = stream
        self.group = group

    @classmethod
    def from_url(cls, url: str, stream: str, group: str) -> EpisodeStream:
        return cls(aioredis.Redis.from_url(url, decode_responses=False), stream, group)

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

    async def append(self, episodes: Sequence[Episode]) -> list[str]:
        """Append episodes atomically (one transaction); returns their entry ids in order."""
        async with self._redis.pipeline(transaction=True) as pipe:
            for ep in episodes:
                pipe.xadd(self.stream, {FIELD: ep.SerializeToString()})
            ids = await pipe.execute()
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    async def read(self, consumer: str, count: int, block_ms: int, pending: bool = False) -> list[StreamEntry]:
        """Read up to ``count`` entries for ``consumer``: its own pending entries (``pending=True``, id 0)
        or new ones (id ``>``), blocking up to ``block_ms`` for new ones."""
        start = "0" if pending else ">"
        reply: Any = await self._redis.xreadgroup(
            self.group, consumer, {self.stream: start}, count=count, block=None if pending else block_ms
        )
        entries: list[StreamEntry] = []
        for _stream, items in reply or []:
            for entry_id, fields in items:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                if not fields or FIELD not in fields:
                    # A pending entry whose data was deleted: nothing to train on, acknowledge it.
                    log.warning("stream entry %s has no episode payload; acknowledging it", eid)
                    await self.ack([eid])
                    continue
                episode = Episode()
                episode.ParseFromString(fields[FIELD])
                entries.append(StreamEntry(eid, episode))
        return entries

    async def ack(self, entry_ids: Sequence[str]) -> int:
        if not entry_ids:
            return 0
        return int(await self._redis.xack(self.stream, self.group, *entry_ids))

    async def info(self) -> GroupInfo:
        length = int(await self._redis.xlen(self.stream))
        groups = await self._redis.xinfo_groups(self.stream)
        for g in groups:
            name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            if name == self.group:
                lag = g.get("lag")
                return GroupInfo(pending=int(g["pending"]), lag=int(lag) if lag is not None else -1,
                                 length=length)
        return GroupInfo(pending=0, lag=length, length=length)
