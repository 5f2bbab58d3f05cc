"""Every Redis key, consumer name and hash field relayrl uses, derived from the ``redis`` config section.

The one place that spells them: the stream, rollout progress, version lineage, the trainer, the launcher's
summary and ``relayrl status`` all take their names from a :class:`RedisKeys` (a test fails when a key suffix
is typed anywhere else). Every key carries the run's name (``name``, ``run`` by default) where the section's names
say ``{run}`` (``redis.stream = relayrl:{run}:episodes``, ``redis.version_key = relayrl:{run}:weight_version``), so
runs sharing a Redis never read each other's state. The keys of run ``run``:

- ``stream`` (``relayrl:run:episodes``): the stream of episode groups, one serialized group per entry under the
  field ``STREAM_FIELD``; ``group`` (``trainer``) is the trainer's consumer group on it and
  ``trainer_consumer(prefix, rank)`` (``trainer-rank0``) the consumer of one rank.
- ``dropped(reason)`` (``relayrl:run:episodes:dropped_stale``, ``...:dropped_reward_error``,
  ``...:dropped_zero_advantage``): hash group id -> episodes of the groups the trainer dropped.
- ``dead_letter`` (``relayrl:run:episodes:dead``): the stream of entries the trainer could not decode or refused,
  each with its original fields plus ``reason`` and ``entry_id``; ``invalid`` (``relayrl:run:episodes:invalid``):
  hash entry id -> episodes of those entries (the ``episodes_invalid`` count).
- ``rollout_progress`` (``relayrl:run:episodes:rollout:progress``): hash of rollout's ``watermark`` (the dataset
  cursor), ``appended`` and ``skipped`` (PROGRESS_* fields); ``rollout_done`` (``...:rollout:done``): the set of
  prompt seqs recorded at or above the watermark.
- ``version_counter`` (``relayrl:run:weight_version``): the INCR counter that allocates weight versions;
  ``versions`` (``...:versions``): hash version -> [lineage, policy step]; ``lineages`` (``...:lineages``):
  hash lineage -> [parent lineage, fork step].

:func:`run_names` lists the runs a Redis holds and :meth:`RedisKeys.state` names what deleting one removes
(``relayrl runs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from relayrl.common.books import DROP_REASONS
from relayrl.config.redis import RUN_FIELD, RedisConfig

_DEFAULTS = RedisConfig()
DEFAULT_RUN = "run"  # RunConfig.name's default

__all__ = ["DEFAULT_RUN", "DROP_REASONS", "DropReason", "RedisKeys", "run_names"]

DropReason = str  # one of DROP_REASONS: the run's books declare them (relayrl.common.books)

# The field of a stream entry that holds one serialized EpisodeGroup.
STREAM_FIELD = b"group"

# Fields of the rollout progress hash.
PROGRESS_WATERMARK = "watermark"
PROGRESS_APPENDED = "appended"
PROGRESS_SKIPPED = "skipped"


def _named(template: str, run: str) -> str:
    return template.replace(RUN_FIELD, run)


@dataclass(frozen=True)
class RedisKeys:
    stream: str = _named(_DEFAULTS.stream, DEFAULT_RUN)
    group: str = _DEFAULTS.group
    version_counter: str = _named(_DEFAULTS.version_key, DEFAULT_RUN)

    @classmethod
    def from_config(cls, cfg: RedisConfig, run: str) -> RedisKeys:
        """The keys of run ``run`` (the run config's ``name``)."""
        return cls(stream=_named(cfg.stream, run), group=cfg.group, version_counter=_named(cfg.version_key, run))

    def state(self) -> list[str]:
        """Every key of the run but its version counter: what `relayrl runs delete` removes. The counter stays (one
        integer), so that a later run of the same name never reuses a version (invariant 4)."""
        books = [self.dropped(reason) for reason in DROP_REASONS]
        rollout = [self.rollout_progress, self.rollout_done]
        return [self.stream, *books, self.dead_letter, self.invalid, *rollout, self.versions, self.lineages]

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


def run_names(client: Any, cfg: RedisConfig) -> list[str]:
    """The names of the runs whose stream or version counter ``client`` (a synchronous Redis client) holds, by
    ``cfg``'s key templates (none when they carry no {run}: every run shares those keys)."""
    names: set[str] = set()
    for template in (cfg.stream, cfg.version_key):
        if RUN_FIELD not in template:
            continue
        head, _, tail = template.partition(RUN_FIELD)
        pattern = re.compile(re.escape(head) + r"(?P<run>[^:]+)" + re.escape(tail))  # run names hold no ':'
        for key in client.scan_iter(match=_glob_escape(head) + "*" + _glob_escape(tail), count=1000):
            found = pattern.fullmatch(key.decode() if isinstance(key, bytes) else key)
            if found:
                names.add(found["run"])
    return sorted(names)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def trainer_consumer(prefix: str, rank: int) -> str:
    """The stable consumer name of trainer rank ``rank`` in the stream's consumer group."""
    return f"{prefix}-rank{rank}"
