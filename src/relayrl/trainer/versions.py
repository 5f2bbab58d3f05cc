"""Weight versions: allocated from a durable monotonic source, never reused.

Scheme: every weight set the trainer publishes gets ``INCR <redis.version_key>`` as its version. Redis runs
with AOF (``appendfsync everysec``), so the counter survives a Redis restart, and a trainer that restarts
from an older checkpoint still allocates versions greater than any it published before. Inference refuses
an update whose version is not greater than the one it serves (FAILED_PRECONDITION).

The version a server starts with, from a model directory on disk, is 0: it is never allocated.
A version that was allocated but never published (a crash during a push) is skipped, not reused. Staleness
is not the difference of version numbers but the optimizer steps between two versions' weights
(:class:`VersionLineage`), which stays exact across skipped versions, re-pushes and resumes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from relayrl.common.redis_keys import RedisKeys

_ALLOCATE = """
local v = redis.call('INCR', KEYS[1])
local floor = tonumber(ARGV[1])
if v <= floor then
  v = floor + 1
  redis.call('SET', KEYS[1], v)
end
return v
"""


class VersionSource:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self.key = keys.version_counter

    async def allocate(self, floor: int = 0) -> int:
        """A new version, greater than every version allocated before and than ``floor`` (the caller's last
        published version): if Redis lost its last second of writes (AOF everysec) the counter is raised
        past ``floor`` instead of handing out a version again. One atomic script."""
        return int(await self._redis.eval(_ALLOCATE, 1, self.key, floor))

    async def latest(self) -> int:
        """The last version allocated (0 when none was)."""
        value = await self._redis.get(self.key)
        return int(value) if value is not None else 0


@dataclass(frozen=True)
class VersionInfo:
    lineage: int  # the first version published by the trainer incarnation that published this one
    step: int  # optimizer steps behind these weights


@dataclass(frozen=True)
class LineageInfo:
    parent: int  # lineage this one resumed from (0: none)
    fork_step: int  # the checkpoint step it resumed at


class VersionLineage:
    """Maps versions to (lineage, step) so that staleness counts optimizer steps between policies, also across
    a restart: a trainer resumed from a checkpoint at step N publishes the restored weights under a fresh
    version, whose lineage forks from the old one at N. The policy distance from version a to version b is
    the number of optimizer steps on the path between them in that tree (weights of a lost lineage beyond
    the fork count both ways). Stored in Redis hashes next to the version counter (RedisKeys.versions and
    .lineages)."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self.versions_key = keys.versions
        self.lineages_key = keys.lineages
        self._versions: dict[int, VersionInfo] = {}
        self._lineages: dict[int, LineageInfo] = {}

    async def register_lineage(self, lineage: int, parent: int, fork_step: int) -> None:
        self._lineages[lineage] = LineageInfo(parent, fork_step)
        await self._redis.hset(self.lineages_key, str(lineage), json.dumps([parent, fork_step]))

    async def register(self, version: int, lineage: int, step: int) -> None:
        self._versions[version] = VersionInfo(lineage, step)
        await self._redis.hset(self.versions_key, str(version), json.dumps([lineage, step]))

    async def info(self, version: int) -> VersionInfo | None:
        if version not in self._versions:
            raw = await self._redis.hget(self.versions_key, str(version))
            if raw is None:
                return None
            lineage, step = json.loads(raw)
            self._versions[version] = VersionInfo(int(lineage), int(step))
        return self._versions[version]

    async def _lineage(self, lineage: int) -> LineageInfo:
        if lineage not in self._lineages:
            raw = await self._redis.hget(self.lineages_key, str(lineage))
            parent, fork = json.loads(raw) if raw is not None else (0, 0)
            self._lineages[lineage] = LineageInfo(int(parent), int(fork))
        return self._lineages[lineage]

    async def distance(self, current: int, token: int) -> int:
        """Optimizer steps between the policy of version ``current`` and that of ``token``. Versions without
        a record (not published by a trainer) fall back to the difference of the numbers."""
        cur, tok = await self.info(current), await self.info(token)
        if cur is None or tok is None:
            return current - token
        lineage, limit = cur.lineage, cur.step
        while True:
            if lineage == tok.lineage:
                if tok.step <= limit:
                    return cur.step - tok.step
                return (cur.step - limit) + (tok.step - limit)  # a lost branch beyond the fork
            parent = await self._lineage(lineage)
            if parent.parent == 0:
                return current - token  # unrelated lineages: fall back to version numbers
            lineage, limit = parent.parent, min(limit, parent.fork_step)
