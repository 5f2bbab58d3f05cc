"""The training loop: collect this rank's groups, step, publish the new version, log, checkpoint.

Ranks: gradients are all-reduced over the global batch (see Learner.rl_gradients), and rank 0 alone allocates
and publishes each weight version and writes metrics (metrics.jsonl and the tracking backends).
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from relayrl.common import books
from relayrl.common.dataset import Prompt, open_prompts
from relayrl.common.logging import log_context
from relayrl.common.metrics_row import MetricsRow, RlRow, SftRow, row_fields
from relayrl.common.model import chat_token_ids
from relayrl.common.pb.common_pb2 import ServingState
from relayrl.common.stream import StreamEntry
from relayrl.config.trainer import StopBudget, graceful_stop_s
from relayrl.trainer.audit import TrainedAudit
from relayrl.trainer.groups import CollectStopped, groups_per_rank, live_consumers
from relayrl.trainer.in_run_eval import InRunEval
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import StepAbandoned, StepStats
from relayrl.trainer.parallel_dims import is_sharded
from relayrl.trainer.parts import LoopParts
from relayrl.trainer.publication import Snapshot
from relayrl.trainer.step_summary import StepSummary, global_summary, set_times
from relayrl.trainer.steptime import Longest, StepClock

log = logging.getLogger(__name__)


def generation_wait(entries: list[StreamEntry], start: float, end: float) -> float | None:
    """Of a wait for a batch from ``start`` to ``end`` (wall clock), the seconds before its last group left
    rollout's workflow (the newest ``enqueued_at`` of its episodes: generated and scored); the rest of the wait
    is the group in transit. None when an episode does not say (a producer that predates the field)."""
    ready = [ep.enqueued_at for e in entries for ep in e.group.episodes]
    if not ready or min(ready) <= 0:
        return None
    return min(max(max(ready) - start, 0.0), max(end - start, 0.0))


class TrainingLoop:
    def __init__(self, parts: LoopParts) -> None:
        cfg, coll = parts.cfg, parts.coll
        self.cfg, self.coll = cfg, coll
        self.learner, self.tokenizer, self.stream = parts.learner, parts.tokenizer, parts.stream
        self.collector, self.publication, self.checkpoints = parts.collector, parts.publication, parts.checkpoints
        self.progress, self.header, self.tracker = parts.progress, parts.header, parts.tracker
        self.resumed_from, self.teacher, self.reference = parts.resumed_from, parts.teacher, parts.reference
        self.is_main = coll.rank == 0
        self._t0 = time.monotonic()
        self._last_step_t = self._t0
        self._prefetch: asyncio.Task[StepBatch] | None = None
        self._generating_s: float | None = None  # of the step's data wait, the part before its batch was generated
        self._row: asyncio.Task[None] | None = None  # rank 0: the last step's row, written beside the next data wait
        self.clock = StepClock()  # where each step's wall time goes (rank 0 reports its own; relayrl.trainer.steptime)
        self.compute_s = 0.0  # the last step's forward and backward
        self.longest = Longest()  # this rank's longest step, push and checkpoint: its graceful stop's deadline
        self.audit = TrainedAudit(cfg.output_dir, coll.rank, cfg.trainer.dump_episodes, parts.resumed_from)
        # rank 0: held-out evaluation every trainer.eval.every_steps, beside training (relayrl.trainer.in_run_eval)
        self.evals = (
            InRunEval(cfg, self._write_metrics, self._t0) if self.is_main and cfg.trainer.eval.every_steps else None
        )
        self.stop = parts.learner.stop
        parts.collector.stop_requested = self.stop.is_set

    @property
    def stepping(self) -> bool:
        """RL steps have begun (after start-up, the first publication and the warm-up): a stop is graceful."""
        return self.header.state == ServingState.SERVING_STATE_SERVING

    def stop_budget(self) -> StopBudget:
        """How long this rank's graceful stop may take: the launcher's rule (``graceful_stop_s``) over the longest
        step, push and checkpoint this rank measured."""
        tc, longest = self.cfg.trainer, self.longest
        return graceful_stop_s(
            longest.step_s, longest.push_s, longest.checkpoint_s, tc.stop_grace_s, tc.stop_grace_max_s
        )

    def request_stop(self) -> None:
        """Stop at the next safe point, then write a final checkpoint and acknowledge what it holds. Safe points:
        waiting for groups, and each micro-batch boundary of a step (agreed by every rank), where the step's
        partial gradients are discarded and its groups stay pending (read again on resume). Thread-safe."""
        self.stop.set()

    async def publish(self, policy_step: int, wait: bool = True, snapshot: Snapshot | None = None) -> int:
        """Publish the current weights (``snapshot``: as the step's compute thread copied them); every rank learns
        the version and whether to checkpoint after this step. ``wait`` false: the push runs on while the loop
        reads its next batch (settled before the next publication and every checkpoint)."""
        version, self.checkpoints.now = await self.publication.publish(
            policy_step, self.checkpoints.requested, wait, snapshot
        )
        self.collector.allocated(version)
        return version

    async def staleness(self, token_version: int) -> int:
        return await self.publication.staleness(token_version)

    async def train(self) -> None:
        tc = self.cfg.trainer
        if self.resumed_from is not None and self.progress.step >= tc.total_steps:
            # a finished run restarted (a pod rescheduled): no weights pushed, no version allocated, nothing trained
            log.info("the run finished at step %d (%s): nothing to train", self.progress.step, self.resumed_from)
            self._announce(ServingState.SERVING_STATE_STOPPED, finished=True)
            return
        await self.collector.ensure_group()  # waits on a full Redis (XGROUP CREATE is refused) like any write
        if self.is_main:
            live = live_consumers(tc.stream.consumer, self.coll.world_size)
            await self.stream.claim_from_gone_consumers(self.collector.consumer, live)
        if not is_sharded(self.learner.model):  # sharded: broadcast before sharding (relayrl.trainer.runtime)
            # identical starting weights on every rank, whatever each loaded
            await asyncio.to_thread(
                self.coll.broadcast_coalesced, list(self.learner.model.parameters()), 0, "initial_weights"
            )
        # The weights we start from get a fresh version too: inference and trainer agree on what is served,
        # and a restarted trainer never reuses a version.
        await self.publish(self.progress.step)
        if tc.sft.warmup_steps > 0 and self.resumed_from is None:
            await self.sft_warmup()
        self._announce(ServingState.SERVING_STATE_SERVING)
        self.clock.reset()  # the first step's cycle starts here, not at start-up
        try:
            while self.progress.step < tc.total_steps:
                try:
                    await self.train_step()
                except StepAbandoned as stopped:
                    self._log_abandoned(stopped)
                    break
                if self.checkpoints.due(self.progress.step, tc.total_steps):
                    t_checkpoint = time.monotonic()
                    with self.clock.part("checkpoint"):
                        await self.checkpoint_and_ack()
                    self.longest.saw(checkpoint_s=time.monotonic() - t_checkpoint)
        finally:
            await self._drop_prefetch()
            await self.publication.drop_prepared()
            await self._row_written()
        if self.progress.step < tc.total_steps:  # stopped
            await self._stop_checkpoint()
            self._announce(ServingState.SERVING_STATE_STOPPED)
            return
        await self.checkpoint_and_ack()
        if self.evals is not None:
            await self.evals.finish(self.progress.step, self.publication.weight_version)
        self._announce(ServingState.SERVING_STATE_STOPPED, finished=True)

    def _announce(self, state: ServingState.ValueType, finished: bool = False) -> None:
        """A new serving state (and, at the end, the finished run), seen by status watchers at once."""
        self.header.state = state
        self.progress.finished = self.progress.finished or finished
        self.progress.changed.notify()

    def _log_abandoned(self, stopped: StepAbandoned) -> None:
        if stopped.total:
            log.info(
                "stop: step %d abandoned at a micro-batch boundary after %d of %d micro-batches (partial "
                "gradients discarded, no optimizer step); its groups stay pending and are read again on resume",
                self.progress.step + 1,
                stopped.done,
                stopped.total,
            )
        else:
            log.info("stop: before step %d (nothing of it computed)", self.progress.step + 1)

    async def _stop_checkpoint(self) -> None:
        """After a stop: the final checkpoint and its acknowledgements, unless no step was trained since the last
        durable one (it is not written again; groups dropped since stay pending, read and dropped again on resume)."""
        step = self.progress.step
        if step == self.checkpoints.last_step:
            log.info("stopped at step %d: the checkpoint of step %d already holds every trained step", step, step)
            return
        await self.checkpoint_and_ack()
        log.info("stopped at step %d with a final checkpoint (every trained group acknowledged)", step)

    async def _batch(self) -> StepBatch:
        """This step's batch (prefetched, or read now). After a stop request a read ends at its next safe point
        (never in the middle of a drop); one rank then abandons the step at once, several take an empty share and
        join the step's collectives, so that every rank agrees to stop at its first micro-batch boundary."""
        prefetched, self._prefetch = self._prefetch, None
        alone = self.coll.world_size == 1
        try:
            if prefetched is None and alone and self.stop.is_set():
                raise CollectStopped("stop requested")
            batch = await (prefetched or self._collect())
        except CollectStopped:
            batch = StepBatch.empty()
        if alone and self.stop.is_set():
            raise StepAbandoned(0, 0)
        return batch

    async def train_step(self) -> None:
        """One optimizer step over the global batch, then its publication, counters and metrics."""
        tc, progress, clock = self.cfg.trainer, self.progress, self.clock
        with clock.part("data"):  # the batch read while the previous step's metrics were written, or read now
            waited_from = time.time()  # wall clock: compared with rollout's enqueued_at
            batch = await self._batch()
            self._generating_s = generation_wait(batch.entries, waited_from, time.time())
        t_step = time.monotonic()
        # rank 0 reads the run's books from Redis while the step computes (this step's drops are recorded)
        books = asyncio.create_task(self._read_books()) if self.is_main else None
        self.publication.prepare(progress.step + 1)  # rank 0: the step's version allocated while it computes
        try:
            stats, snapshot, summary, summary_s = await asyncio.to_thread(self._compute, batch)
        except BaseException:
            if books is not None:
                books.cancel()
            raise
        clock.add("fwd_bwd", stats.fwd_bwd_s)
        self.compute_s = stats.fwd_bwd_s  # whether borrowing generation's cores is worth it (relayrl.trainer.cores)
        clock.add("optimizer", stats.optimizer_s)
        clock.add("metrics", summary_s)
        with clock.part("metrics"):
            for entry in batch.entries:
                self.collector.consumed(entry)
                if log.isEnabledFor(logging.DEBUG):
                    with log_context(group_id=entry.group.group_id):
                        log.debug(
                            "trained group at step %d (%d episodes: %s)",
                            progress.step + 1,
                            len(entry.group.episodes),
                            ", ".join(ep.episode_id for ep in entry.group.episodes),
                        )
            self.audit.trained(progress.step + 1, batch.entries)
        clock.add("publish", snapshot[1] if snapshot is not None else 0.0)  # the copy, taken in the compute thread
        with clock.part("publish"):
            await self.publish(progress.step + 1, wait=not tc.publication.overlap, snapshot=snapshot)
        progress.advance()
        if progress.step < tc.total_steps and not self.checkpoints.due(progress.step, tc.total_steps):
            # the next batch is read (or waited for) while this step's metrics are summed and written; never
            # across a checkpoint, which acknowledges what was consumed before it
            self._prefetch = asyncio.create_task(self._collect(), name=f"collect-step-{progress.step + 1}")
        with clock.part("metrics"):
            progress.episodes_trained += summary.episodes
            progress.exclude(summary.reward_errors)
            progress.groups_trained += tc.groups_per_step
            if books is not None:
                await books
        step_s = time.monotonic() - t_step
        last_push = self.publication.last_push
        self.longest.saw(step_s, push_s=last_push.seconds if last_push is not None else 0.0)
        await self._log_step(summary, batch, stats, step_s)
        if self.evals is not None:
            self.evals.after_step(progress.step, self.publication.weight_version, progress.step >= tc.total_steps)

    def _compute(self, batch: StepBatch) -> tuple[StepStats, Snapshot | None, StepSummary, float]:
        """In the compute thread: the step (never beside another snapshot for publication) and rank 0's copy of the
        weights it publishes, then its statistics over every rank (the same collectives in the same order on every
        rank, right after the step's); the seconds the statistics took."""
        stats, snapshot = self.publication.step_and_snapshot(self.learner.rl_step, batch)
        t0 = time.perf_counter()
        summary = global_summary(self.coll, self.cfg.rollout.max_staleness, batch)
        return stats, snapshot, summary, time.perf_counter() - t0

    async def _collect(self) -> StepBatch:
        """This rank's share of the next batch. No collective: it may run beside the previous step's metrics."""
        tc = self.cfg.trainer
        taken = await self.collector.collect(groups_per_rank(tc.groups_per_step, self.coll.world_size), self.staleness)
        # each episode's staleness (of its oldest token): one lineage look-up per distinct version, not per episode
        lags = {v: await self.staleness(v) for v in dict.fromkeys(v for ing in taken for v in ing.oldest_each)}
        batch = StepBatch.take(taken, lags)  # errored episodes left out: their groups train on the valid ones
        if not batch.episodes:
            return batch
        teacher = await self.teacher.logprobs(batch.episodes) if self.teacher is not None else None
        reference = await self.reference.logprobs(batch.episodes) if self.reference is not None else None
        return batch.scored(teacher, reference)

    async def _drop_prefetch(self) -> None:
        """Cancel a read of the next batch nobody will train (an error or a stop): its entries stay pending."""
        task, self._prefetch = self._prefetch, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _read_books(self) -> None:
        """Rank 0: drop and invalid counts and the queue depth from Redis (for the step's row and status)."""
        await self.progress.refresh_drops(self.stream, self.cfg.redis.retry_s)  # the queue depth too

    async def sft_warmup(self) -> None:
        sft = self.cfg.trainer.sft
        rows = open_prompts(self.cfg.rollout.dataset_spec()).train  # never the held-out rows
        eos = int(self.tokenizer.eos_token_id)

        def encode(r: Prompt) -> tuple[list[int], list[int]]:  # the rows a step draws, when it draws them
            prompt = (
                chat_token_ids(self.tokenizer, r.chat())
                if r.messages  # as inference renders it
                else self.tokenizer(r.prompt, add_special_tokens=False)["input_ids"]
            )
            return prompt, [*self.tokenizer(r.answer, add_special_tokens=False)["input_ids"], eos]

        gen = torch.Generator().manual_seed(self.cfg.seed * 1000 + self.coll.rank)
        per_rank = max(1, sft.batch_size // self.coll.world_size)
        for i in range(1, sft.warmup_steps + 1):
            enc = [encode(rows[j]) for j in torch.randint(len(rows), (per_rank,), generator=gen).tolist()]
            stats = await asyncio.to_thread(
                self.publication.locked, self.learner.sft_step, [e[0] for e in enc], [e[1] for e in enc]
            )
            self._write_metrics(
                SftRow(sft_step=i, loss=stats.loss, grad_norm=stats.grad_norm, time_s=time.monotonic() - self._t0), i
            )
        log.info("supervised warm-up done (%d steps)", sft.warmup_steps)
        await self.publish(self.progress.step)

    async def checkpoint_and_ack(self) -> None:
        await self.publication.settle()  # a checkpoint never records a version whose push may still fail
        saving = asyncio.ensure_future(
            self.checkpoints.save_and_ack(
                self.progress.step, self.publication.weight_version, self.progress.checkpoint_counters()
            )
        )
        try:
            await asyncio.shield(saving)
        except asyncio.CancelledError:
            # a stop during a checkpoint lets it finish: once the checkpoint is durable its groups are trained,
            # and left unacknowledged they would also be pending (counted twice in the books, read again)
            await saving
            raise

    def _write_metrics(self, row: MetricsRow, step: int) -> None:
        """Rank 0: one row to metrics.jsonl and the tracking backends, ``step`` as its x-axis."""
        if self.tracker is not None:
            self.tracker.log(row.to_json(), step)

    async def _log_step(self, summary: StepSummary, batch: StepBatch, stats: StepStats, step_s: float) -> None:
        if not self.is_main:
            return
        p, last_push = self.progress, self.publication.last_push
        queue_lag, queue_pending = p.queue_depth
        with self.clock.part("metrics"):
            components: dict[str, list[float]] = {}
            for ep in batch.episodes:  # components of rank 0's share (names may differ between ranks)
                for k, v in ep.reward_components.items():
                    components.setdefault(k, []).append(v)
        now = time.monotonic()
        times = self.clock.close(now)
        p.last_reward_mean = summary.reward_mean
        row = RlRow(
            step=p.step,
            weight_version=self.publication.weight_version,
            reward_components={k: sum(v) / len(v) for k, v in sorted(components.items())},
            episodes_per_s=summary.episodes / max(now - self._last_step_t, 1e-9),
            step_time_s=step_s,
            time_s=now - self._t0,
            world_size=self.coll.world_size,
            queue_lag=queue_lag,
            queue_pending=queue_pending,
            **row_fields(summary),
            **row_fields(stats),
        )  # the step's and the learner's figures, by name
        for name, value in books.values(p).items():  # the run's totals (relayrl.common.books)
            setattr(row, name, value)
        if last_push is not None:
            row.weight_sync_s, row.weight_sync_bytes = last_push.seconds, last_push.bytes_sent
            row.probe_max_diff = last_push.probe_max_diff
        set_times(row, times, self.publication)
        if self._generating_s is not None:  # unknown: both stay 0 (not measured)
            row.time_data_generating_s = min(self._generating_s, times.parts["data"])  # the rest is transit
            row.time_data_transit_s = times.parts["data"] - row.time_data_generating_s
        self._last_step_t = now
        for lag, count in summary.staleness_hist.items():
            p.staleness_counts[int(lag)] = p.staleness_counts.get(int(lag), 0) + count
        await self._row_written()  # rows in step order
        self._row = asyncio.create_task(self._write_row(row, stats.loss), name=f"row-{p.step}")

    async def _write_row(self, row: RlRow, loss: float) -> None:
        """The step's row to the trackers and its log line: a task that runs while the loop waits for its next
        batch (or beside the next step's compute, when the batch is there), off the step's critical path and
        counted in no part of it."""
        self._write_metrics(row, row.step)
        with log_context(weight_version=row.weight_version):
            log.info(
                "step %d version %d reward %.3f staleness max %d loss %.4f",
                row.step,
                row.weight_version,
                row.reward_mean,
                row.staleness_max,
                loss,
            )

    async def _row_written(self) -> None:
        """Wait for the last step's row to be written (its error raised here)."""
        task, self._row = self._row, None
        if task is not None:
            await task

    def close(self) -> None:
        if self.evals is not None:
            self.evals.cancel()
        self.audit.close()
