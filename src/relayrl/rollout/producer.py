"""The rollout loop: admit groups within the staleness bound (see admission.py), generate, score, append.

Inference, reward and the trainer are called through the typed clients (relayrl.client) with the retry policies
of :class:`RolloutClients`: a brief UNAVAILABLE is retried inside the call; a call that still fails fails its
group, which is tried again up to ``rollout.max_group_attempts`` times (each failure counted), then skipped.
Redis is different: an append that cannot land within ``redis.retry_s`` (Redis unreachable, or full) stops the loop
with :class:`AppendFailed` (every later append would meet the same Redis); the groups not recorded are generated
again on restart (relayrl.rollout.progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import grpc

from relayrl.client.inference_pool import InferencePool
from relayrl.common.books import groups_left
from relayrl.common.dataset import Prompt, PromptCursor
from relayrl.common.episodes import reward_failed
from relayrl.common.logging import bind_log_context
from relayrl.common.pb import episode_pb2, reward_pb2, trainer_pb2
from relayrl.common.pb.common_pb2 import ServingState
from relayrl.common.retry import redis_retry
from relayrl.common.stream import EpisodeStream
from relayrl.config.rollout import RolloutConfig
from relayrl.rollout.admission import Admission, TrainerView
from relayrl.rollout.clients import RolloutClients
from relayrl.rollout.group_commit import AppendFailed, GroupCommit
from relayrl.rollout.joining import JoinedInference, JoinedScorer
from relayrl.rollout.progress import Progress
from relayrl.rollout.turns import TurnCounters
from relayrl.rollout.workflows.api import GroupFailed, WorkflowContext
from relayrl.rollout.workflows.loader import build_workflow

log = logging.getLogger(__name__)

# While admission waits for the trainer, its status is polled this many times as often: the window reopens when a
# step is published, and a full status_poll_s of lag per step would leave the engine idle meanwhile. (Polling is the
# fallback: rollout follows the trainer's WatchStatus stream, which brings each change at once.)
BLOCKED_POLL_DIVISOR = 5
# Deadline of one WatchStatus stream; rollout subscribes again when it passes.
WATCH_DEADLINE_S = 60.0


class RolloutProducer:
    def __init__(
        self,
        cfg: RolloutConfig,
        stream: EpisodeStream,
        cursor: PromptCursor,
        clients: RolloutClients,
        redis_retry_s: float = 60.0,
        model_path: Path | None = None,
        score_batch_max: int | None = None,
        generate_batch_samples: int | None = None,
    ) -> None:
        self.cfg = cfg
        joined = cfg.score_batch_max if score_batch_max is None else score_batch_max
        # the workflows' clients: concurrent groups' calls joined into one (rollout.score_batch_max,
        # rollout.generate_batch_max; relayrl.rollout.joining)
        self.reward = JoinedScorer(clients.reward, joined) if joined > 0 else clients.reward
        # (at most generate_batch_samples samples a GenerateBatch: inference.max_samples_per_request)
        self.inference: Any = clients.inference
        if cfg.generate_batch_max > 0:
            joined_calls = lambda c: JoinedInference(  # noqa: E731
                c, cfg.generate_batch_max, generate_batch_samples, cfg.generate_calls_in_flight
            )
            if isinstance(clients.inference, InferencePool):  # each replica joins its own calls
                clients.inference.join_calls(joined_calls)
            else:
                self.inference = joined_calls(clients.inference)
        self.redis_retry_s = redis_retry_s
        self.stream = stream
        self.cursor = cursor
        self.clients = clients
        self.producer_id = cfg.producer_id or f"{socket.gethostname()}:{os.getpid()}"
        self.trainer_view = TrainerView()
        self.admission = Admission(cfg.max_staleness)
        # each group's XADD with the record of its prompt seq, by group commit (relayrl.rollout.group_commit)
        self.appends = GroupCommit(stream, redis_retry_s, on_oom=self._on_oom, after_try=self._append_unblocked)
        self.groups_produced = 0  # by this process
        self.episodes_produced = 0
        self.groups_failed = 0
        self.groups_skipped = 0
        self.episodes_reward_errors = 0  # episodes appended with a failed score (ERROR or TIMEOUT)
        self.running = 0
        self._next_seq = 0
        self._retry: deque[tuple[int, int]] = deque()  # (seq, attempt)
        self._appending: set[asyncio.Future[None]] = set()
        self._wake = asyncio.Event()
        self.paused = False  # by an operator: admit no new group
        self.append_blocked = False  # Redis refuses the append for lack of memory: admit no new group meanwhile
        self.redis_oom_retries = 0  # appends refused by a full Redis (maxmemory, noeviction) and retried
        self.refused_while_paused = 0  # admission decisions the loop made (and refused) while paused
        self.wait_s: dict[str, float] = {}  # seconds the loop waited, by blocked_by() reason
        self._poll_now = asyncio.Event()  # the window is closed: refresh the trainer's view without waiting
        # a ConfigError names the field that cannot load
        self.workflow, self.environment = build_workflow(cfg, model_path, reward=clients.reward)
        self.turns = TurnCounters()  # multi-turn counters (turns, tool calls and errors, how episodes ended)

    def can_admit(self) -> bool:
        return self.blocked_by() is None

    def blocked_by(self) -> str | None:
        """Why no group can be admitted now (None: one can): paused, redis_full, concurrency (max_concurrent_groups
        running), trainer (not serving, unreachable or publishing) or window (the staleness bound is reached)."""
        if self.paused:
            return "paused"
        if self.append_blocked:
            return "redis_full"
        if self.running >= self.cfg.max_concurrent_groups:
            return "concurrency"
        if self.admission.can_admit(self.trainer_view):
            return None
        return "window" if self.admission.limit(self.trainer_view) > 0 else "trainer"

    def set_paused(self, paused: bool, reason: str = "") -> None:
        if paused != self.paused:
            log.info("generation %s%s", "paused" if paused else "resumed", f" ({reason})" if reason else "")
        self.paused = paused
        self._wake.set()

    async def refresh_trainer(self) -> None:
        try:
            st = await self.clients.trainer.status()
        except grpc.aio.AioRpcError as exc:
            self._trainer_unreachable(exc)
            return
        self._see_trainer(st)

    def _trainer_unreachable(self, exc: grpc.aio.AioRpcError) -> None:
        if self.trainer_view.reachable:
            log.warning("trainer status unavailable: %s", exc.code().name)
        self.trainer_view = TrainerView()  # admit nothing until the trainer answers again

    def _see_trainer(self, st: trainer_pb2.TrainerStatus) -> None:
        if isinstance(self.clients.inference, InferencePool):  # replicas that missed a push take no request
            self.clients.inference.set_behind(st.inference_replicas_behind)
        self.trainer_view = TrainerView(
            step=st.step,
            weight_version=st.weight_version,
            groups_per_step=st.groups_per_step,
            finished=st.finished,
            reachable=True,
            publishing=st.publishing,
            groups_dropped=groups_left(st),
            serving=st.component.state == ServingState.SERVING_STATE_SERVING,
        )

    async def _follow_trainer(self, stop: asyncio.Event) -> None:
        """Follow the trainer's WatchStatus stream (each change wakes admission at once), subscribing again when a
        stream's deadline passes; poll GetStatus instead where the trainer has no WatchStatus."""
        while not stop.is_set():
            try:
                async for st in self.clients.trainer.watch_status(WATCH_DEADLINE_S):
                    self._see_trainer(st)
                    self._wake.set()
                    if st.finished:
                        return
                stream_ended = True  # the trainer ended the stream (it is stopping): subscribe again after a pause
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("the trainer has no WatchStatus; polling its status every %.2fs", self.cfg.status_poll_s)
                    await self._poll_trainer(stop)
                    return
                # the deadline only ends one subscription; any other error means the trainer is out of reach
                stream_ended = exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
                if stream_ended:
                    self._trainer_unreachable(exc)
                    self._wake.set()
            if stream_ended:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.cfg.status_poll_s)

    async def _poll_trainer(self, stop: asyncio.Event) -> None:
        """Every status_poll_s; while admission waits for the trainer (window closed, publishing), every
        status_poll_s / BLOCKED_POLL_DIVISOR, so a finished step reopens the window without a full poll's lag."""
        while not stop.is_set():
            await self.refresh_trainer()
            self._wake.set()
            if self.trainer_view.finished:
                return
            if self.blocked_by() in ("window", "trainer"):
                await asyncio.sleep(self.cfg.status_poll_s / BLOCKED_POLL_DIVISOR)
                continue
            self._poll_now.clear()
            with contextlib.suppress(TimeoutError):  # the interval passed: poll as usual
                await asyncio.wait_for(self._poll_now.wait(), self.cfg.status_poll_s)

    @property
    def next_seq(self) -> int:
        """Sequence number of the next new prompt."""
        return self._next_seq

    async def resume(self) -> None:
        """Continue where the stream says this rollout stopped (see progress.py)."""
        await self.appends.load()
        self.admission.admitted = self.progress.appended
        self._next_seq = self.progress.next_seq()
        self._retry.extend((seq, 1) for seq in self.progress.missing())
        if self._next_seq:
            log.info(
                "resuming at prompt seq %d (%d groups appended before, %d to regenerate)",
                self._next_seq,
                self.progress.appended,
                len(self._retry),
            )

    async def run(self, stop: asyncio.Event) -> None:
        # XGROUP CREATE is refused by a full Redis even when the group exists: a restart waits like an append
        await redis_retry(
            self.stream.ensure_group, "consumer group creation", self.redis_retry_s, on_oom=self._count_oom
        )
        await self.resume()
        poller = asyncio.create_task(self._follow_trainer(stop))
        tasks: set[asyncio.Task[None]] = set()
        try:
            while not stop.is_set() and not self.trainer_view.finished and self.appends.failure is None:
                reason = self.blocked_by()
                if reason is not None:
                    self.refused_while_paused += self.paused
                    if reason in ("window", "trainer"):
                        self._poll_now.set()
                    self._wake.clear()
                    t0 = time.monotonic()
                    waiter = asyncio.create_task(self._wake.wait())
                    stopper = asyncio.create_task(stop.wait())
                    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    stopper.cancel()
                    self.wait_s[reason] = self.wait_s.get(reason, 0.0) + time.monotonic() - t0
                    continue
                if self._retry:
                    seq, attempt = self._retry.popleft()
                else:
                    seq, attempt = self._next_seq, 1
                    self._next_seq += 1
                self.admission.admit()
                self.running += 1
                task = asyncio.create_task(self._group(seq, attempt))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            poller.cancel()
            if tasks:  # let groups in flight finish (or fail) briefly, then cancel the rest
                await asyncio.wait(tasks, timeout=self.cfg.drain_timeout_s)
            for t in tasks:
                t.cancel()
            await asyncio.gather(poller, *tasks, return_exceptions=True)
            await asyncio.gather(*self._appending, return_exceptions=True)
            close = getattr(self.workflow, "close", None)
            if close is not None:  # a workflow that holds resources (the agent workflow's session endpoint)
                await close()
        log.info(
            "rollout loop ended: %d groups produced, %d failed attempts, %d skipped",
            self.groups_produced,
            self.groups_failed,
            self.groups_skipped,
        )
        if self.appends.failure is not None:
            raise self.appends.failure

    async def _group(self, seq: int, attempt: int) -> None:
        prompt = self.cursor.at(seq)
        try:
            episodes = await self.make_group(prompt)
            # an append that started completes and is counted even if this task is cancelled meanwhile
            appending = asyncio.ensure_future(self._append(seq, episodes))
            self._appending.add(appending)
            appending.add_done_callback(self._appending.discard)
            await asyncio.shield(appending)
        except (GroupFailed, grpc.aio.AioRpcError) as exc:
            self.admission.release()
            self.groups_failed += 1
            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            if attempt < self.cfg.max_group_attempts:
                log.warning("group for prompt %s failed (attempt %d): %s; will retry", prompt.prompt_id, attempt, why)
                self._retry.append((seq, attempt + 1))
            else:
                self.groups_skipped += 1
                log.error("group for prompt %s failed %d times, skipping it: %s", prompt.prompt_id, attempt, why)
                with contextlib.suppress(AppendFailed):  # the loop stops; the seq is regenerated on restart
                    await self.appends.record(seq, None)
        except AppendFailed:  # not this group's fault: the loop stops, the group is generated again on restart
            self.admission.release()
            self.groups_failed += 1
        except asyncio.CancelledError:
            self.admission.release()
            raise
        except Exception:  # one failed group never kills the loop
            self.admission.release()
            self.groups_failed += 1
            self.groups_skipped += 1
            log.exception("unexpected error in group for prompt %s; skipping it", prompt.prompt_id)
        finally:
            self.running -= 1
            self._wake.set()

    async def _append(self, seq: int, episodes: list[episode_pb2.Episode]) -> None:
        """One transaction: the group's XADD and the record of its prompt seq (see progress.py)."""
        group = episode_pb2.EpisodeGroup(group_id=episodes[0].group_id, episodes=episodes, prompt_seq=seq)
        await self.appends.record(seq, group)
        self.groups_produced += 1
        self.episodes_produced += len(episodes)

    @property
    def progress(self) -> Progress:
        """What Redis records of this rollout's prompts (relayrl.rollout.progress)."""
        return self.appends.progress

    def _append_unblocked(self) -> None:
        """An append went through or gave up: admission no longer waits for Redis memory."""
        if self.append_blocked:
            self.append_blocked = False
            self._wake.set()

    def _count_oom(self) -> None:
        self.redis_oom_retries += 1

    def _on_oom(self) -> None:
        """A full Redis refused the append (nothing of the MULTI applied): count it, and admit nothing until the
        append goes through (backpressure: the group waits, it is neither lost nor appended twice)."""
        self._count_oom()
        self.append_blocked = True

    def state(self) -> dict[str, int]:
        """Counters and the dataset position, written to <output_dir>/rollout_state.json at shutdown."""
        epoch, index = self.cursor.position(self._next_seq)
        return {
            "groups_produced": self.groups_produced,
            "episodes_produced": self.episodes_produced,
            "groups_failed": self.groups_failed,
            "groups_skipped": self.groups_skipped,
            "episodes_reward_errors": self.episodes_reward_errors,
            "redis_oom_retries": self.redis_oom_retries,
            "groups_appended_total": self.progress.appended,
            "next_seq": self._next_seq,
            "watermark": self.progress.watermark,
            "dataset_epoch": epoch,
            "dataset_index": index,
            **self.turns.state(),
            **self._joined_calls(),
            **{f"wait_ms_{reason}": round(s * 1000) for reason, s in sorted(self.wait_s.items())},
        }

    def _joined_calls(self) -> dict[str, int]:
        """ScoreBatch and GenerateBatch calls made for the workflows, and the workflows' calls they carried."""
        out: dict[str, int] = {}
        for name, client in (("score", self.reward), ("generate", self.inference)):
            callers = [r.caller for r in client.replicas] if isinstance(client, InferencePool) else [client]
            joiners = [c.joiner for c in callers if isinstance(c, JoinedScorer | JoinedInference)]
            if joiners:
                out[f"{name}_calls"] = sum(j.calls for j in joiners)
                out[f"{name}_calls_joined"] = sum(j.callers for j in joiners)
        return out

    async def make_group(self, prompt: Prompt) -> list[episode_pb2.Episode]:
        """One group from the configured workflow (rollout.workflow), checked and counted."""
        group_id = uuid.uuid4().hex
        bind_log_context(group_id=group_id)  # the rest of this group's task (_group), its failure warnings too
        ctx = WorkflowContext(
            inference=self.inference,
            reward=self.reward,
            group_id=group_id,
            group_size=self.cfg.group_size,
            producer_id=self.producer_id,
            created_at=time.time(),
            config=self.cfg,
            environment=self.environment,
        )
        episodes = await self.workflow(prompt, ctx)
        # an agent's sessions give as many episodes as their call chains (relayrl.rollout.workflows.agent_session)
        expected = len(episodes) if self.cfg.workflow == "agent" and episodes else self.cfg.group_size
        if len(episodes) != expected or any(e.group_size != expected for e in episodes):
            raise GroupFailed(f"the workflow returned {len(episodes)} episodes, expected {expected}, each saying so")
        bad = [e for e in episodes if reward_failed(e)]
        if bad:  # appended all the same, marked: the trainer excludes and counts them (trainer.on_reward_error)
            self.episodes_reward_errors += len(bad)
            log.warning(
                "reward failed for %d of %d episodes of prompt %s: %s %s",
                len(bad),
                len(episodes),
                prompt.prompt_id,
                reward_pb2.ScoreStatus.Name(bad[0].reward_status),
                bad[0].reward_error,
            )
        self.turns.count(episodes)
        return episodes
