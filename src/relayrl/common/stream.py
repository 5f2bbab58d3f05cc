"""The Redis stream that carries episode groups from rollout to the trainer.

Each stream entry holds one serialized :class:`EpisodeGroup` (the n samples of one prompt) under the field
``group`` (every key and field name: relayrl.common.redis_keys): a group is delivered, acknowledged and
normalised as a whole, so no consumer holds part of one. The trainer reads through a consumer group
(at-least-once delivery): entries stay pending until acknowledged, and it acknowledges only once a checkpoint
holding their effect is durable. Backpressure comes from admission control, not from deleting entries: the
stream is trimmed only below the oldest entry some consumer group still needs (:meth:`EpisodeStream.trim_acked`:
never an unread or unacknowledged entry).

An entry that cannot be decoded (:class:`BadEntry`) or that the trainer refuses is moved by
:meth:`EpisodeStream.dead_letter` to the dead-letter stream ``<stream>:dead`` (its fields plus ``reason``), counted
in ``<stream>:invalid`` and acknowledged, in one script: it is never lost, counted twice or read again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from relayrl.common.episodes import EpisodeDecodeError, decode_group
from relayrl.common.pb.episode_pb2 import EpisodeGroup
from relayrl.common.redis_conn import async_client
from relayrl.common.redis_keys import DROP_REASONS, STREAM_FIELD, DropReason, RedisKeys
from relayrl.config.redis import RedisConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamEntry:
    entry_id: str
    group: EpisodeGroup
    fields: dict[bytes, bytes] = field(default_factory=dict, compare=False, repr=False)  # as read (dead-letter copy)


@dataclass(frozen=True)
class BadEntry:
    """A stream entry that does not decode to an episode group: it goes to the dead-letter stream."""

    entry_id: str
    fields: dict[bytes, bytes]
    reason: str


# Dead-letter one entry, once: count it (HSETNX: a retry after a lost reply counts and copies nothing twice), copy
# its fields with the reason to the dead-letter stream (capped at ARGV[3] entries, the oldest go), acknowledge it.
# KEYS: stream, dead-letter stream, invalid hash. ARGV: entry id, episodes, maxlen, group, then field/value pairs.
_DEAD_LETTER = """
if redis.call('HSETNX', KEYS[3], ARGV[1], ARGV[2]) == 1 then
  local args = {'XADD', KEYS[2], 'MAXLEN', ARGV[3], '*'}
  for i = 5, #ARGV do args[#args + 1] = ARGV[i] end
  redis.call(unpack(args))
end
return redis.call('XACK', KEYS[1], ARGV[4], ARGV[1])
"""


def _next_id(entry_id: str) -> str:
    """The smallest stream id greater than ``entry_id``."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True)
class Books:
    """What the trainer reports of the stream after each step: drops by reason and invalid entries as (groups,
    episodes) over every rank and restart, and the consumer group's queue depth."""

    dropped: dict[str, tuple[int, int]]  # DropReason -> (groups, episodes)
    invalid: tuple[int, int]
    lag: int | None  # entries not yet delivered (None where Redis cannot tell)
    pending: int  # delivered, not acknowledged


@dataclass(frozen=True)
class GroupInfo:
    """Consumer-group counters, in stream entries (groups)."""

    pending: int  # delivered to a consumer, not acknowledged
    lag: int  # not delivered yet
    length: int  # entries in the stream


def _counts(values: Any) -> tuple[int, int]:
    """(groups, episodes) of a drop or invalid hash's values (group id -> its episodes)."""
    return len(values), sum(int(v) for v in values)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class EpisodeStream:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self.keys = keys
        self.stream = keys.stream
        self.group = keys.group

    @classmethod
    def from_config(cls, cfg: RedisConfig, run: str) -> EpisodeStream:
        """Run ``run``'s stream (``redis.url``, its keys named by the ``redis`` section and the run's name)."""
        return cls(async_client(cfg, decode_responses=False), RedisKeys.from_config(cfg, run))

    @classmethod
    def from_url(cls, url: str, stream: str, group: str) -> EpisodeStream:
        """The stream named ``stream`` (a key, no placeholder) at ``url``."""
        return cls.from_config(RedisConfig(url=url, stream=stream, group=group), "")

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

    def _parse(self, items: Any) -> list[StreamEntry | BadEntry]:
        entries: list[StreamEntry | BadEntry] = []
        for entry_id, fields in items or []:
            try:
                entries.append(StreamEntry(_text(entry_id), decode_group(fields), dict(fields)))
            except EpisodeDecodeError as exc:
                entries.append(BadEntry(_text(entry_id), dict(fields or {}), str(exc)))
        return entries

    async def read(
        self, consumer: str, count: int, block_ms: int, pending_after: str | None = None
    ) -> list[StreamEntry | BadEntry]:
        """Read up to ``count`` entries for ``consumer``: its own pending entries with ids after
        ``pending_after`` (``"0"`` for all), or, when it is None, new entries (id ``>``), blocking up to
        ``block_ms`` for them. An entry that does not decode comes back as a :class:`BadEntry`."""
        start: str = ">" if pending_after is None else pending_after
        reply: Any = await self._redis.xreadgroup(
            self.group, consumer, {self.stream: start}, count=count, block=block_ms if pending_after is None else None
        )
        return [e for _stream, items in reply or [] for e in self._parse(items)]

    async def ack(self, entry_ids: Sequence[str]) -> int:
        if not entry_ids:
            return 0
        return int(await self._redis.xack(self.stream, self.group, *entry_ids))

    async def dead_letter(
        self, entry_id: str, fields: dict[bytes, bytes], reason: str, episodes: int, maxlen: int
    ) -> None:
        """Move one entry to the dead-letter stream (its ``fields`` plus ``reason``), count it as invalid (with its
        ``episodes``) and acknowledge it: one atomic script, idempotent (a retry copies and counts nothing
        twice)."""
        flat: list[Any] = []
        for key, value in fields.items():
            flat += [key, value]
        flat += [b"reason", reason.encode(), b"entry_id", entry_id.encode()]
        await self._redis.eval(
            _DEAD_LETTER,
            3,
            self.stream,
            self.keys.dead_letter,
            self.keys.invalid,  # type: ignore[misc]
            entry_id,
            episodes,
            maxlen,
            self.group,
            *flat,
        )

    async def invalid(self) -> tuple[int, int]:
        """(groups, episodes) moved to the dead-letter stream, over every rank and restart."""
        return _counts(await self._redis.hvals(self.keys.invalid))

    async def trim_acked(self) -> str | None:
        """Trim the stream below the oldest entry any consumer group still needs: its oldest pending
        (unacknowledged) entry, or, with none pending, the entry after its last delivered one. Never an unread
        or unacknowledged entry. Exact (``MINID``, not ``~``): it runs once per checkpoint and removes only what
        was acknowledged since the previous one. Returns the MINID used (None: nothing to trim)."""
        try:
            groups: Any = await self._redis.xinfo_groups(self.stream)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return None
            raise
        bounds: list[str] = []
        for g in groups:
            summary: Any = await self._redis.xpending(self.stream, _text(g["name"]))
            oldest = summary.get("min") if int(summary.get("pending") or 0) else None
            bounds.append(_text(oldest) if oldest is not None else _next_id(_text(g["last-delivered-id"])))
        if not bounds:
            return None  # no consumer group: nobody has read anything
        minid = min(bounds, key=_id_key)
        if minid == "0-1":
            return None
        await self._redis.xtrim(self.stream, minid=minid, approximate=False)
        return minid

    async def claim_from_gone_consumers(self, consumer: str, live: set[str]) -> int:
        """Move the pending entries of consumers not in ``live`` (e.g. ranks of a larger earlier run) to
        ``consumer``. Returns how many entries were claimed."""
        claimed = 0
        for info in await self._redis.xinfo_consumers(self.stream, self.group):
            name = _text(info["name"])
            if name in live or int(info["pending"]) == 0:
                continue
            rows: Any = await self._redis.xpending_range(
                self.stream, self.group, min="-", max="+", count=int(info["pending"]), consumername=name
            )
            ids: list[Any] = [_text(r["message_id"]) for r in rows]
            if ids:
                await self._redis.xclaim(
                    self.stream, self.group, consumer, min_idle_time=0, message_ids=ids, justid=True
                )
                claimed += len(ids)
                log.info("claimed %d pending entries of gone consumer %s", len(ids), name)
        return claimed

    async def record_dropped(self, group_id: str, episodes: int, reason: DropReason = "stale") -> None:
        """Record a group dropped by the trainer, as too stale (``stale``) or because every episode of it failed
        scoring (``reward_error``). Idempotent: a group dropped again after a restart counts once."""
        await self._redis.hset(self.keys.dropped(reason), group_id, episodes)

    async def dropped(self, reason: DropReason = "stale") -> tuple[int, int]:
        """(groups, episodes) dropped for ``reason``, over every rank and restart."""
        return _counts(await self._redis.hvals(self.keys.dropped(reason)))

    async def books(self) -> Books:
        """Every drop and invalid count and the queue depth, in one round trip (a pipeline without MULTI: each
        count is exact on its own; they are read within the same moment, not atomically together)."""
        pipe = self._redis.pipeline(transaction=False)
        for reason in DROP_REASONS:
            pipe.hvals(self.keys.dropped(reason))
        pipe.hvals(self.keys.invalid)
        pipe.xinfo_groups(self.stream)
        *counts, groups = await pipe.execute(raise_on_error=False)
        for value in counts:
            if isinstance(value, Exception):
                raise value
        entry = self._find_group(groups)
        lag = entry.get("lag") if entry is not None else None
        pairs = [_counts(values) for values in counts]
        return Books(
            dropped=dict(zip(DROP_REASONS, pairs[:-1], strict=True)),
            invalid=pairs[-1],
            lag=int(lag) if lag is not None else None,
            pending=int(entry["pending"]) if entry else 0,
        )

    def _find_group(self, groups: Any) -> dict[Any, Any] | None:
        """Our group's entry of an XINFO GROUPS reply; None before the stream (an error reply) or the group exist."""
        if isinstance(groups, ResponseError):
            if "no such key" in str(groups).lower():
                return None
            raise groups
        if isinstance(groups, Exception):
            raise groups
        for g in groups:
            if _text(g["name"]) == self.group:
                return dict(g)
        return None

    async def _group_entry(self) -> dict[Any, Any] | None:
        """The consumer group's XINFO GROUPS entry; None before the stream or the group exists."""
        try:
            groups = await self._redis.xinfo_groups(self.stream)
        except ResponseError as exc:
            return self._find_group(exc)  # no stream yet: nothing appended, an empty queue, not an error
        return self._find_group(groups)

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
