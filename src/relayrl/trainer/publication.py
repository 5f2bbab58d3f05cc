"""Weight versions: allocation, lineage and publication to inference (rank 0).

Rank 0 allocates each version from the durable Redis counter, records its lineage and policy step, and pushes
the (full, replicated) weights; every rank learns the version by a broadcast from rank 0. A push whose answer
was lost after it landed is verified by pushing the same snapshot again under a fresh version of the same
policy step (so a landed push is a success, never a stale-version stop). Staleness of a sample is measured along
the lineage (relayrl.trainer.versions), so that it stays right across a resume.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from relayrl.common.logging import log_context
from relayrl.common.retry import OomBackpressure, redis_retry
from relayrl.config.tls import TlsConfig
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.served import served_version
from relayrl.trainer.transports import Weights
from relayrl.trainer.versions import VersionLineage, VersionSource
from relayrl.trainer.weight_sync import PushResult, WeightPublisher

log = logging.getLogger(__name__)

T = TypeVar("T")

VERIFY_ATTEMPTS = 3  # fresh versions tried when a push landed but its answer (the probe) was lost

Snapshot = tuple[Weights, float]  # weights copied for a publication, and the seconds the copy took


@dataclass(frozen=True)
class Ahead:
    """What a step's publication can have before the step ends (rank 0): the version it will take, allocated and
    registered while the step computes (:meth:`VersionPublication.prepare`), and the copy of the weights taken in the
    compute thread right after the optimizer step (:meth:`VersionPublication.step_and_snapshot`)."""

    version: int | None = None
    snapshot: Snapshot | None = None


class VersionPublication:
    """The current weight version, its lineage, and publishing new ones (narrow: what the loop and watchdog use)."""

    def __init__(
        self,
        publisher: WeightPublisher,
        versions: VersionSource,
        lineage: VersionLineage,
        coll: Collectives,
        inference_target: str | list[str],
        retry_s: float,
        resumed_version: int = 0,
        tls: TlsConfig | None = None,
        sharded: bool = False,
        inference_wait_s: float = 0.0,
        backpressure: OomBackpressure | None = None,
    ) -> None:
        self.publisher = publisher
        self.backpressure = backpressure or OomBackpressure("trainer")  # a full Redis: allocation waits, retries
        self.inference_wait_s = inference_wait_s  # the first publication's wait for an inference still loading
        self.sharded = sharded  # FSDP2: every rank takes part in gathering the weights before each publication
        self.versions = versions
        self.lineage_db = lineage
        self.coll = coll
        self.is_main = coll.rank == 0
        # the inference replicas' gRPC targets (their served versions)
        self.inference_targets = [inference_target] if isinstance(inference_target, str) else list(inference_target)
        self.tls = tls
        self.retry_s = retry_s
        self.resumed_version = resumed_version  # version of the restored weights, when resuming
        self.weight_version = 0
        self.lineage = 0  # set at the first publication (rank 0)
        self.on_change: Callable[[], None] = lambda: None  # the status changed (a push started or ended)
        self._publishing = False
        self.last_push: PushResult | None = None
        self.last_probe: PushResult | None = None  # the last push that ran the probe (most are confirmed without)
        self.served_step = -1  # policy step of the last verified push
        self._pending: asyncio.Task[int] | None = None  # a push started by publish(wait=False)
        self._push_lock = asyncio.Lock()  # a publication and a re-push never interleave
        self._gather_s = 0.0  # FSDP2: the last gather's seconds, counted in its push's serialise_s
        self.settle_wait_s = 0.0  # the last publish()'s wait for the previous push still in flight (overlap)
        self._prepared: tuple[int, asyncio.Task[int]] | None = None  # (policy step, its version's allocation)
        self._newest_allocated = 0  # the last version this publication allocated (a prepared one must still be it)
        # a snapshot for publication, or the probe of one (rank 0 only), never overlaps an optimizer step
        self._weights_lock = threading.Lock()
        if self.is_main:
            publisher.model_lock = self._weights_lock

    @property
    def publishing(self) -> bool:
        """A push is in flight (rollout's admission counts on the served step meanwhile)."""
        return self._publishing

    @publishing.setter
    def publishing(self, value: bool) -> None:
        self._publishing = value
        self.on_change()

    def locked(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` (an optimizer step) so that it never overlaps a snapshot for publication."""
        with self._weights_lock:
            return fn(*args)

    def step_and_snapshot(self, fn: Callable[..., T], *args: Any) -> tuple[T, Snapshot | None]:
        """In the compute thread: ``fn`` (an optimizer step), then, under the same hold of the weights lock, rank 0's
        copy of the weights its publication pushes (unsharded; sharded, the publication gathers them on every rank):
        the copy costs no thread hand-off of its own after the step. None where this rank takes no copy, and while the
        previous push is still in flight (its copy is alive until it ends: the publication copies after it settled,
        so that no more than one copy beside the model exists, on the model's device)."""
        with self._weights_lock:
            out = fn(*args)
            pending = self._pending  # read across threads: a push that ends just after this takes the old path
            if not self.is_main or self.sharded or (pending is not None and not pending.done()):
                return out, None
            t0 = time.perf_counter()
            return out, (self.publisher.snapshot(), time.perf_counter() - t0)

    def prepare(self, policy_step: int) -> asyncio.Task[int] | None:
        """Rank 0, as a step starts computing: allocate and register the version that the step's publication (of
        ``policy_step``) takes, so that the publication does not wait for those Redis round trips after the step. A
        version allocated meanwhile by anything else (the watchdog's re-push, a re-verification) is newer, and
        inference refuses a version older than the one it serves: the prepared one is then skipped, never reused,
        and the publication allocates another. Nothing before the first publication. Returns the allocation, which
        :meth:`publish` awaits (None: nothing prepared)."""
        if not self.is_main or self.weight_version == 0 or self._prepared is not None:
            return None
        task = asyncio.create_task(self._allocate(policy_step, self.weight_version), name=f"allocate-{policy_step}")
        self._prepared = (policy_step, task)
        return task

    async def drop_prepared(self) -> None:
        """Cancel a prepared allocation nobody will publish (the step was abandoned or failed): a version it
        allocated is skipped (versions are never reused)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            prepared[1].cancel()
            await asyncio.gather(prepared[1], return_exceptions=True)

    async def _ahead(self, policy_step: int, snapshot: Snapshot | None) -> Ahead:
        """The prepared version of ``policy_step`` (its allocation's error raised here), and ``snapshot``."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return Ahead(None, snapshot)
        step, task = prepared
        version = await task
        return Ahead(version if step == policy_step else None, snapshot)

    async def publish(
        self, policy_step: int, flag: bool = False, wait: bool = True, snapshot: Snapshot | None = None
    ) -> tuple[int, bool]:
        """Rank 0 publishes a fresh version of the current weights; every rank gets it, with rank 0's ``flag``
        (the operator's checkpoint request), by one broadcast. Returns (version, flag).

        ``wait`` false (the training loop's overlap): rank 0 takes the snapshot and allocates and registers the
        version now (so staleness, measured along the lineage from this version, is exact at once), and pushes
        in the background while training goes on; :meth:`settle` waits for that push (and raises its error). The
        next publication settles the previous one first. ``snapshot``: the weights as the step left them, copied in
        the compute thread (:meth:`step_and_snapshot`); else copied here."""
        message = torch.zeros(2, dtype=torch.int64)  # [version, flag]
        if self.sharded:  # FSDP2: every rank takes part in gathering the full tensors, which rank 0 streams into a
            # fresh file (a push still in flight keeps reading its own)
            t0 = time.perf_counter()
            await asyncio.to_thread(self.locked, self.publisher.gather, self.is_main)
            self._gather_s = time.perf_counter() - t0  # rank 0 wrote and hashed the file meanwhile: serialising
        if self.is_main:
            t_settle = time.perf_counter()
            await self.settle()
            self.settle_wait_s = time.perf_counter() - t_settle
            self.publishing = True
            try:
                ahead = await self._ahead(policy_step, snapshot)
                floor = self.weight_version or await self.served_version(self.inference_wait_s)
                if wait:
                    message[0] = await self.allocate_and_push(policy_step, floor, ahead=ahead)
                else:
                    message[0] = await self._start_push(policy_step, floor, ahead)
            finally:
                self.publishing = self._pending is not None
            message[1] = int(flag)
        await self.coll.off_loop(self.coll.broadcast, message, 0, "published_version")
        self.weight_version = int(message[0])
        self.on_change()
        return self.weight_version, bool(message[1])

    async def settle(self) -> None:
        """Wait for the push started by ``publish(wait=False)``, if any; re-raise its error."""
        task, self._pending = self._pending, None
        if task is not None:
            try:
                await task
            finally:
                self.publishing = False

    async def abandon(self) -> None:
        """Stop a background push that nobody will settle (the trainer is closing after an error or a stop): its
        version was never checkpointed, and the next run allocates above it (versions are never reused). Closes the
        publisher's channel."""
        task, self._pending = self._pending, None
        if task is not None and not task.done():
            task.cancel()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)  # collected: no "exception never retrieved"
        self.publishing = False
        await self.drop_prepared()
        await self.publisher.close()

    async def allocate_and_push(
        self, policy_step: int, floor: int, only: list[str] | None = None, ahead: Ahead = Ahead()
    ) -> int:
        """Rank 0: a fresh version above ``floor``, recorded with its lineage and policy step (or the one ``ahead``
        prepared), then the push (to the replicas ``only``, by their weights targets: the watchdog's catch-up).
        Serialised: a step's publication and a watchdog re-push never interleave."""
        async with self._push_lock:
            params, version, snapshot_s = await self._snapshot_and_allocate(policy_step, floor, ahead)
            return await self._push_verified(params, version, policy_step, snapshot_s, only)

    async def _start_push(self, policy_step: int, floor: int, ahead: Ahead) -> int:
        """Rank 0: snapshot and version now; the push in a task that holds the push lock until it is done."""
        await self._push_lock.acquire()
        try:
            params, version, snapshot_s = await self._snapshot_and_allocate(policy_step, floor, ahead)
        except BaseException:
            self._push_lock.release()
            raise

        async def push() -> int:
            try:
                return await self._push_verified(params, version, policy_step, snapshot_s)
            finally:
                self.publishing = False
                self._push_lock.release()

        self._pending = asyncio.create_task(push(), name=f"publish-v{version}")
        # let it start: a task cancelled before it ever ran (abandon() right after this publication, with nothing
        # awaited between) would never reach its finally, and the push lock would stay taken for good
        await asyncio.sleep(0)
        return version

    async def _snapshot_and_allocate(self, policy_step: int, floor: int, ahead: Ahead) -> tuple[Weights, int, float]:
        """Under the push lock: the weights (``ahead``'s copy, else one now) and their version (``ahead``'s while it
        is still the newest this publication allocated, else a fresh one)."""
        if ahead.snapshot is not None:
            params, snapshot_s = ahead.snapshot
        else:
            t0 = time.perf_counter()
            params = await asyncio.to_thread(self.locked, self.publisher.snapshot)  # never a half-updated model
            snapshot_s = time.perf_counter() - t0
        snapshot_s, self._gather_s = snapshot_s + self._gather_s, 0.0  # a re-push gathers nothing
        if ahead.version is not None and ahead.version == self._newest_allocated:
            return params, ahead.version, snapshot_s
        if ahead.version is not None:
            log.debug("prepared version %d skipped: %d was allocated since", ahead.version, self._newest_allocated)
        return params, await self._allocate(policy_step, floor), snapshot_s

    async def _push_verified(
        self, params: Weights, version: int, policy_step: int, snapshot_s: float, only: list[str] | None = None
    ) -> int:
        for _ in range(VERIFY_ATTEMPTS):
            with log_context(weight_version=version):
                result = await self.publisher.push(params, version, only)
            if result.verified:
                break
            # inference serves this version but its answer (probe, served check) was lost: the same weights as a
            # fresh version (a version it serves is refused as stale) bring it back; both map to the same policy step
            version = await self._allocate(policy_step, version)
            log.info("verifying the landed weights by a push as version %d", version)
        else:
            raise RuntimeError(
                f"weight version {version}: the push landed {VERIFY_ATTEMPTS} times without an "
                "answer; the served weights are unverified"
            )
        pushed = result.timings  # the snapshot is part of serialising
        self.last_push = replace(
            result,
            timings=replace(pushed, serialise_s=pushed.serialise_s + snapshot_s, total_s=pushed.total_s + snapshot_s),
        )
        if result.probe_max_diff is not None:
            self.last_probe = self.last_push
        self.served_step = policy_step
        t = self.last_push.timings
        checks = ("served weights confirmed" if result.served_verified else "") + (
            f"{'; ' if result.served_verified else ''}probe max |Δ logprob| {result.probe_max_diff:.2e}"
            if result.probe_max_diff is not None
            else ""
        )
        # every step publishes: a line each at DEBUG (the metrics row has the same figures), at INFO where the probe
        # checked the served weights
        log.log(
            logging.INFO if result.probe_max_diff is not None else logging.DEBUG,
            "published weight version %d (%d bytes, %.3fs: serialise %.3f transfer %.3f swap %.3f probe %.3f; %s)",
            version,
            result.bytes_sent,
            t.total_s,
            t.serialise_s,
            t.transfer_s,
            t.swap_s,
            t.probe_s,
            checks,
        )
        return version

    def admission_step(self, step: int) -> int:
        """The step rollout's admission may count on: ``step``, or while a push is in flight the policy step
        inference is known to serve (its version was verified), so the window never runs ahead of the weights
        that generate."""
        return step if not self.publishing else min(step, max(self.served_step, 0))

    async def _allocate(self, policy_step: int, floor: int) -> int:
        """A fresh version, registered with its lineage and policy step, before anything is pushed under it. Each
        write is retried on its own through an outage or a full Redis (backpressure, up to ``redis.retry_s``): a
        refused allocation script applied nothing (the counter is not raised, no version is consumed), and a
        registration is retried for the version already allocated, never under a new one. A reply lost in an
        outage can only skip a version, never hand one out twice."""
        version = await redis_retry(
            lambda: self.versions.allocate(floor=floor),
            "version allocation",
            self.retry_s,
            backpressure=self.backpressure,
        )
        self._newest_allocated = max(self._newest_allocated, version)
        with log_context(weight_version=version):
            await redis_retry(
                lambda: self._register(version, policy_step),
                "version registration",
                self.retry_s,
                backpressure=self.backpressure,
            )
        return version

    async def _register(self, version: int, policy_step: int) -> None:
        """Record the version (and, at this incarnation's first publication, its lineage): idempotent HSETs, so a
        retry after a refusal or a lost reply writes the same records again."""
        lineage = self.lineage or version
        if self.lineage == 0:  # first publication of this incarnation: a new lineage, forked at resume
            parent = 0
            if self.resumed_version:
                info = await self.lineage_db.info(self.resumed_version)
                parent = info.lineage if info is not None else 0
            await self.lineage_db.register_lineage(lineage, parent, policy_step)
            self.lineage = lineage  # only once recorded: a retry records it again
        await self.lineage_db.register(version, lineage, policy_step)

    async def staleness(self, token_version: int) -> int:
        """Optimizer steps between the current weights and those that produced ``token_version``."""
        return await redis_retry(
            lambda: self.lineage_db.distance(self.weight_version, token_version), "staleness", self.retry_s
        )

    async def served_version(self, wait_s: float = 0.0) -> int:
        """The newest version any inference replica serves now (a floor for the first allocation after a restart:
        versions are never reused); see :func:`served_version`. RuntimeError when no replica answers."""
        return max(await self._served_versions(wait_s))

    def replicas_behind(self) -> list[str]:
        """The gRPC addresses of the replicas whose last push failed (rollout routes nothing to them)."""
        behind = self.publisher.behind
        return [a for a, w in zip(self.inference_targets, self.publisher.targets, strict=True) if w in behind]

    def push_failures(self) -> dict[str, int]:
        """Weight pushes that failed or lagged, per replica by its gRPC address (TrainerStatus.weight_push_failures)."""
        failed = self.publisher.failed_pushes
        return {a: failed.get(w, 0) for a, w in zip(self.inference_targets, self.publisher.targets, strict=True)}

    async def lagging_replicas(self) -> list[str]:
        """The weights targets of the replicas that answer and need the current weights: they serve an older
        version (restarted, joined late) or their last push failed. Empty while no version is published."""
        asked = await self._ask_each(0.0)
        return [
            w
            for w, v in zip(self.publisher.targets, asked, strict=True)
            if isinstance(v, int) and (v < self.weight_version or w in self.publisher.behind)
        ]

    async def _served_versions(self, wait_s: float) -> list[int]:
        asked = await self._ask_each(wait_s)
        versions = [v for v in asked if isinstance(v, int)]
        if not versions:
            raise next(e for e in asked if isinstance(e, BaseException))
        return versions

    async def _ask_each(self, wait_s: float) -> list[int | BaseException]:
        return list(
            await asyncio.gather(
                *(served_version(t, self.tls, wait_s) for t in self.inference_targets), return_exceptions=True
            )
        )
