"""Weight versions: allocated from a durable monotonic source, never reused.

Scheme: every weight set the trainer publishes gets ``INCR <redis.version_key>`` as its version. Redis runs
with AOF (``appendfsync everysec``), so the counter survives a Redis restart, and a trainer that restarts
from an older checkpoint still allocates versions greater than any it published before. Inference refuses
an update whose version is not greater than the one it serves (FAILED_PRECONDITION).

The version a server starts with, from a model directory on disk, is 0: it is never allocated.
A version that was allocated but never published (a crash during a push) is skipped, not reused, so
staleness measured in versions is an upper bound on the number of publications in between.
"""

from __future__ import annotations

import redis.asyncio as aioredis

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
    def __init__(self, client: aioredis.Redis, key: str) -> None:
        self._redis = client
        self.key = key

    async def allocate(self, floor: int = 0) -> int:
        """A new version, greater than every version allocated before and than ``floor`` (the caller's last
        published version): if Redis lost its last second of writes (AOF everysec) the counter is raised
        past ``floor`` instead of handing out a version again. One atomic script."""
        return int(await self._redis.eval(_ALLOCATE, 1, self.key, floor))

    async def latest(self) -> int:
        """The last version allocated (0 when none was)."""
        value = await self._redis.get(self.key)
        return int(value) if value is not None else 0
