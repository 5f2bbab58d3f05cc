"""Every Redis key, consumer name and hash field relayrl uses, derived from the ``redis`` config section.

The one place that spells them: the stream, rollout progress, version lineage, the trainer, the launcher's
summary and ``relayrl status`` all take their names from a :class:`RedisKeys` (a test fails when a key suffix
is typed anywhere else). Names with their defaults (``redis.stream = relayrl:episodes``,
``redis.version_key = relayrl:weight_version``):

- ``stream`` (``relayrl:episodes``): the stream of episode groups, one serialized group per entry under the
  field ``STREAM_FIELD``; ``group`` (``trainer``) is the trainer's consumer group on it and
  ``trainer_consumer(prefix, rank)`` (``trainer-rank0``) the consumer of one rank.
- ``dropped(reason)`` (``relayrl:episodes:dropped_stale``, ``...:dropped_reward_error``,
  ``...:dropped_zero_advantage``): hash group id ->
  episodes of the groups the trainer dropped.
- ``dead_letter`` (``relayrl:episodes:dead``): the stream of entries the trainer could not decode or refused,
  each with its original fields plus ``reason`` and ``entry_id``; ``invalid`` (``relayrl:episodes:invalid``):
  hash entry id -> episodes of those entries (the ``episodes_invalid`` count).
- ``rollout_progress`` (``relayrl:episodes:rollout:progress``): hash of rollout's ``watermark``, ``appended``
  and ``skipped`` (PROGRESS_* fields); ``rollout_done`` (``relayrl:episodes:rollout:done``): the set of prompt
  seqs recorded at or above the watermark.
- ``version_counter`` (``relayrl:weight_version``): the INCR counter that allocates weight versions;
  ``versions`` (``...:versions``): hash version -> [lineage, policy step]; ``lineages`` (``...:lineages``):
  hash lineage -> [parent lineage, fork step].

Rollout progress and drops hang off the stream's name, the lineage hashes off the counter's, so two runs that
share a Redis but not a stream (or a counter) never mix their books.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.common.books import DROP_REASONS
from relayrl.config.redis import RedisConfig

_DEFAULTS = RedisConfig()

__all__ = ["DROP_REASONS", "DropReason", "RedisKeys"]

DropReason = str  # one of DROP_REASONS: the run's books declare them (relayrl.common.books)

# The field of a stream entry that holds one serialized EpisodeGroup.
STREAM_FIELD = b"group"

# Fields of the rollout progress hash.
PROGRESS_WATERMARK = "watermark"
PROGRESS_APPENDED = "appended"
PROGRESS_SKIPPED = "skipped"


@dataclass(frozen=True)
class RedisKeys:
    stream: str = _DEFAULTS.stream
    group: str = _DEFAULTS.group
    version_counter: str = _DEFAULTS.version_key

    @classmethod
    def from_config(cls, cfg: RedisConfig) -> RedisKeys:
        return cls(stream=cfg.stream, group=cfg.group, version_counter=cfg.version_key)

    def dropped(self, reason: DropReason = "stale") -> str:
        """Hash of the groups the trainer dropped for ``reason`` (group id -> its episodes)."""
        return f"{self.stream}:dropped_{reason}"

    @property
    def dead_letter(self) -> str:
        """Stream of the entries the trainer could not decode or validate (original fields + ``reason``)."""
        return f"{self.stream}:dead"

    @property
    def invalid(self) -> str:
        """Hash entry id -> episodes of the entries moved to the dead-letter stream."""
        return f"{self.stream}:invalid"

    @property
    def rollout_progress(self) -> str:
        """Hash of rollout's counters and watermark (fields PROGRESS_*)."""
        return f"{self.stream}:rollout:progress"

    @property
    def rollout_done(self) -> str:
        """Set of the prompt seqs recorded at or above the watermark."""
        return f"{self.stream}:rollout:done"

    @property
    def versions(self) -> str:
        """Hash version -> JSON [lineage, policy step]."""
        return f"{self.version_counter}:versions"

    @property
    def lineages(self) -> str:
        """Hash lineage -> JSON [parent lineage, fork step]."""
        return f"{self.version_counter}:lineages"


def trainer_consumer(prefix: str, rank: int) -> str:
    """The stable consumer name of trainer rank ``rank`` in the stream's consumer group."""
    return f"{prefix}-rank{rank}"
