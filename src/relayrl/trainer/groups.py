"""Reading this rank's groups from the stream, and dropping (and counting) those that cannot be trained.

Staleness of a sample (one definition, used for filtering and metrics): the number of optimizer steps between
the weights the trainer computes the gradient with (its latest published version) and the weights that
produced the sample's oldest token, counted along the version lineage (relayrl.trainer.versions) so that it
stays right across a resume. Groups with a sample beyond ``rollout.max_staleness`` are dropped, recorded in
Redis and counted (``groups_dropped_stale``, ``episodes_dropped_stale``); nothing is dropped silently.

Reward errors (an episode whose reward status is ERROR or TIMEOUT: its verifier failed, so its reward means
nothing): with ``trainer.on_reward_error: drop`` such episodes are excluded from the loss and counted
(``episodes_dropped_reward_error``). The rest of their group is trained as a smaller group: advantages are
computed over its valid episodes only, since a failed score is no evidence about the sample. A group with no
valid episode is dropped like a stale one, recorded in Redis and counted (``groups_dropped_reward_error``).
With ``fail`` the trainer stops with an error naming the episode, before training its group.

Zero-advantage groups (DAPO's dynamic sampling, ``trainer.dynamic_sampling``): a group whose valid episodes all
have the same reward carries no advantage under a group baseline, so no policy gradient. When enabled, such a
group is dropped, recorded in Redis and counted (``groups_dropped_zero_advantage``, with its episodes) and the
collector reads another in its place; rollout's admission counts the drop and admits a replacement. Bounded: each
rank drops at most ``max_drop_ratio`` x its share of groups per step; past that, zero-advantage groups are trained
(their policy gradient is zero) rather than waiting for ever on prompts the policy has solved or cannot solve.

Invalid entries: every entry read is decoded and validated (relayrl.common.episodes: lengths agree, ids in the
vocabulary, versions not newer than the version counter, finite values, ...) before anything else looks at it.
One that fails, or whose staleness comes out negative (a version the lineage places after the trainer's
weights), is moved to the dead-letter stream ``<stream>:dead`` with the reason, counted (``groups_invalid``,
``episodes_invalid``) and acknowledged at once, in one idempotent script (EpisodeStream.dead_letter): it is never
trained, never read again, and never stops the trainer. Groups produced = trained + dropped as stale + dropped
for reward errors + dropped with zero advantage + invalid + pending.

A full Redis (``maxmemory`` under ``noeviction``) refuses the dead-letter script and the drop records whole: the
collector waits and retries each for up to ``redis.retry_s`` (counted in the trainer's OomBackpressure), consumes
nothing meanwhile, and goes on exactly where it was once memory frees; past the bound the trainer stops with an
OutOfMemoryError naming it.

Ranks: every rank reads its own share of groups as the stable Redis consumer ``<consumer>-rank<r>``
(groups_per_step / world_size groups per step); pending entries of consumers that no longer exist (a larger
earlier world size) are claimed by rank 0 (:func:`consumer_name`, :func:`live_consumers`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from relayrl.common.episodes import Limits, validate_group
from relayrl.common.logging import log_context
from relayrl.common.pb import reward_pb2
from relayrl.common.redis_keys import trainer_consumer
from relayrl.common.retry import OomBackpressure, redis_retry
from relayrl.common.stream import BadEntry, EpisodeStream, StreamEntry
from relayrl.config.trainer import RewardErrorPolicy
from relayrl.trainer.ingest import Ingested, Verdict, judge

log = logging.getLogger(__name__)

T = TypeVar("T")


def consumer_name(prefix: str, rank: int) -> str:
    """The stable Redis consumer of ``rank``: the same name across restarts, so its pending entries come back."""
    return trainer_consumer(prefix, rank)


def live_consumers(prefix: str, world_size: int) -> set[str]:
    return {consumer_name(prefix, r) for r in range(world_size)}


def groups_per_rank(groups_per_step: int, world_size: int) -> int:
    """Each rank's share of a step's groups (the config guarantees divisibility)."""
    return groups_per_step // world_size


class CollectStopped(Exception):
    """A stop was requested while this rank waited for its groups: what it read stays ready in memory and pending
    in the stream (read again on resume); nothing it consumed is lost (dropped groups are recorded as consumed)."""


class RewardErrorStop(RuntimeError):
    """An episode's scoring failed and ``trainer.on_reward_error`` is ``fail``."""


StalenessFn = Callable[[int], Awaitable[int]]  # token version -> optimizer steps behind the current weights


@dataclass(frozen=True)
class EntryChecks:
    """What the collector checks each entry against (relayrl.common.episodes.Limits) and where refused ones go."""

    vocab_size: int
    max_completion_tokens: int
    newest_version: Callable[[], Awaitable[int]]  # the last version allocated (the version counter)
    dead_letter_maxlen: int = 10000


class GroupCollector:
    """Reads this rank's groups: pending ones first, skipping groups a checkpoint already holds, then new
    ones; drops (and counts) groups beyond the staleness bound."""

    def __init__(
        self,
        stream: EpisodeStream,
        consumer: str,
        max_staleness: int,
        block_ms: int,
        already_done: set[str],
        checks: EntryChecks,
        retry_s: float = 60.0,
        on_reward_error: RewardErrorPolicy = RewardErrorPolicy.DROP,
        zero_advantage_drop_ratio: float | None = None,
        backpressure: OomBackpressure | None = None,
    ) -> None:
        self.checks = checks
        # writes refused by a full Redis wait and retry (shared by the trainer's parts: relayrl.trainer.runtime)
        self.backpressure = backpressure or OomBackpressure("trainer")
        # dynamic sampling: None leaves zero-advantage groups in; else drops per collect <= ratio x groups asked
        self.zero_advantage_drop_ratio = zero_advantage_drop_ratio
        self._zero_advantage_budget = 0
        # the version counter as last read, or a version allocated since (re-read when an entry claims a newer one)
        self._newest_version = 0
        self.retry_s = retry_s
        self.on_reward_error = on_reward_error
        self.seen: set[str] = set()  # group ids this incarnation took (ready, trained or dropped)
        self.stream = stream
        self.consumer = consumer
        self.max_staleness = max_staleness
        self.block_ms = block_ms
        self.already_done = already_done  # group ids whose effect the restored checkpoint holds
        self._ready: list[Ingested] = []
        self._pending_after: str | None = "0"  # page through our own pending entries first, then new ones
        self.consumed_ids: list[str] = []  # groups trained or dropped since the last checkpoint
        self.unacked: list[str] = []  # their stream entry ids (acknowledged after the next checkpoint)
        self.done_on_resume: list[str] = []  # entry ids of groups the restored checkpoint holds
        # a stop request: collect raises CollectStopped between two reads (never in the middle of a drop)
        self.stop_requested: Callable[[], bool] = lambda: False

    async def collect(self, num_groups: int, staleness: StalenessFn) -> list[Ingested]:
        """This rank's next ``num_groups`` groups to train, each ingested once (relayrl.trainer.ingest); the groups
        judged otherwise meanwhile are dropped and counted, or dead-lettered."""
        ratio = self.zero_advantage_drop_ratio
        self._zero_advantage_budget = int(ratio * num_groups) if ratio is not None else 0
        while True:
            await self._judge_waiting(staleness)
            if len(self._ready) >= num_groups:
                taken, self._ready = self._ready[:num_groups], self._ready[num_groups:]
                return taken
            if self.stop_requested():  # within read_block_ms of the request
                raise CollectStopped(f"stopped waiting for groups ({len(self._ready)} of {num_groups} ready)")
            # read only the shortfall: a rank that took more than its share could starve the others
            count, after = num_groups - len(self._ready), self._pending_after
            entries = await redis_retry(
                lambda c=count, a=after: self.stream.read(
                    self.consumer,
                    count=c,
                    block_ms=self.block_ms,  # type: ignore[misc]
                    pending_after=a,
                ),
                "read",
                self.retry_s,
                on_reconnect=self._rescan,
            )
            if self._pending_after is not None and after == self._pending_after:
                self._pending_after = entries[-1].entry_id if entries else None
            waiting = {r.group_id for r in self._ready}
            for entry in entries:
                if isinstance(entry, BadEntry):
                    await self.dead_letter(entry.entry_id, entry.fields, entry.reason, 0)
                    continue
                gid = entry.group.group_id
                if gid in waiting:
                    continue  # seen again by a rescan, still waiting to be trained
                if gid in self.already_done:
                    self.done_on_resume.append(entry.entry_id)  # its effect is in the checkpoint: no retraining
                elif gid in self.seen:
                    # trained or dropped already, delivered again (Redis lost a delivery or an ack in a crash):
                    # never train twice; acknowledge it with the next checkpoint
                    self.unacked.append(entry.entry_id)
                else:
                    ingested = Ingested.of(entry)
                    if (reason := await self._invalid(ingested)) is not None:
                        await self.dead_letter(entry.entry_id, entry.fields, reason, len(entry.group.episodes))
                    else:
                        self.seen.add(gid)
                        self._ready.append(ingested.valid())  # its columns built now, while others arrive

    def allocated(self, version: int) -> None:
        """``version`` was allocated from the version counter (this rank publishes or trains it): the counter is at
        least that, and entries whose versions are not newer need no read of it. The trainer allocates every
        version, so one read per published version is saved on the path from a step's last group to its batch."""
        self._newest_version = max(self._newest_version, version)

    async def _invalid(self, ingested: Ingested) -> str | None:
        """Why the trainer must not train on ``ingested`` (relayrl.common.episodes), or None."""
        if ingested.newest > self._newest_version:  # allocated since we last looked, or from the future: ask
            self._newest_version = await redis_retry(self.checks.newest_version, "newest version", self.retry_s)
        limits = Limits(self.checks.vocab_size, self.checks.max_completion_tokens, self._newest_version)
        return validate_group(ingested.entry.group, limits, ingested.lists)

    async def dead_letter(self, entry_id: str, fields: dict[bytes, bytes], reason: str, episodes: int) -> None:
        """Move an entry to the dead-letter stream, count it and acknowledge it (one idempotent script)."""
        await self._write(
            lambda: self.stream.dead_letter(
                entry_id,
                fields,
                reason,
                episodes,  # type: ignore[misc]
                self.checks.dead_letter_maxlen,
            ),
            "dead letter",
        )
        log.warning("moved stream entry %s to %s: %s", entry_id, self.stream.keys.dead_letter, reason)

    async def ensure_group(self) -> None:
        """The stream and its consumer group, created if absent (a full Redis refuses even an XGROUP CREATE of
        a group that exists: it waits like any write)."""
        await self._write(self.stream.ensure_group, "consumer group creation")

    async def _write(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        """A write to Redis, retried through an outage and, as backpressure, through a full Redis (its command or
        script refused whole: nothing applied) for up to ``redis.retry_s``; the collector goes on only once it is
        applied, so nothing is consumed, counted or acknowledged before it."""
        return await redis_retry(op, what, self.retry_s, backpressure=self.backpressure)

    def _rescan(self) -> None:
        """After a Redis outage, page through our pending entries again: acks or deliveries may be lost."""
        self._pending_after = "0"

    async def _judge_waiting(self, staleness: StalenessFn) -> None:
        """Judge each waiting group (:func:`relayrl.trainer.ingest.judge`) and act on its verdict: keep it, drop it
        (recorded in Redis at once, so rollout's admission releases it without waiting for a step, and counted),
        or dead-letter it. With ``trainer.on_reward_error: fail`` an errored episode stops the trainer first."""
        keep: list[Ingested] = []
        for ing in self._ready:
            if ing.failed and self.on_reward_error is RewardErrorPolicy.FAIL:
                raise self._reward_error_stop(ing)
            lag, ahead = await staleness(ing.oldest), await staleness(ing.newest)
            verdict, why = judge(ing, lag, ahead, self.max_staleness, self._zero_advantage_budget > 0)
            entry = ing.entry
            if verdict is Verdict.OK:
                keep.append(ing)
            elif verdict is Verdict.INVALID:
                await self.dead_letter(entry.entry_id, entry.fields, why, ing.size)
            else:
                if verdict is Verdict.ZERO_ADVANTAGE:
                    self._zero_advantage_budget -= 1
                with log_context(group_id=ing.group_id):
                    await self._write(
                        lambda e=entry, r=verdict.value: self.stream.record_dropped(  # type: ignore[misc]
                            e.group.group_id, len(e.group.episodes), r
                        ),
                        "record drop",
                    )
                    self.consumed(entry)
                    log.log(
                        logging.INFO if verdict is Verdict.ZERO_ADVANTAGE else logging.WARNING,
                        "dropped group %s: %s",
                        ing.group_id,
                        why,
                    )
        self._ready = keep

    @staticmethod
    def _reward_error_stop(ing: Ingested) -> RewardErrorStop:
        ep = ing.entry.group.episodes[ing.failed[0]]
        return RewardErrorStop(
            f"episode {ep.episode_id} of group {ing.group_id} has reward status "
            f"{reward_pb2.ScoreStatus.Name(ep.reward_status)}: {ep.reward_error} "
            f"({len(ing.failed)} of {ing.size} failed; trainer.on_reward_error is fail)"
        )

    def consumed(self, entry: StreamEntry) -> None:
        self.consumed_ids.append(entry.group.group_id)
        self.unacked.append(entry.entry_id)
