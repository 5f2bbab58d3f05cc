"""Hold under attack, finding 5: a stop (SIGTERM) during a long step is honoured at the next micro-batch boundary,
not at the end of the step, with a final checkpoint whose groups are acknowledged; the abandoned step's groups stay
pending, and a resume trains them (or drops them as stale), never a group the checkpoint holds: books add up.

The trainer runs under its real entry point (relayrl.trainer.main.serve, signal handlers included) beside real
inference, reward and rollout in this process; micro_batch_size 1 makes every step 8 micro-batches. A hook in the
learner's forward sends this process SIGTERM during micro-batch 2 of step 3 and holds that micro-batch until the
stop has reached the learner: the stop is observed by events (the log, the checkpoint, the stream), not by time."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.common.dataset import PromptCursor, open_prompts
from relayrl.common.pb.episode_pb2 import EpisodeGroup
from relayrl.common.redis_keys import PROGRESS_APPENDED, STREAM_FIELD
from relayrl.common.stream import EpisodeStream
from relayrl.config import RunConfig
from relayrl.rollout.clients import RolloutClients
from relayrl.rollout.producer import RolloutProducer
from relayrl.trainer import learner as learner_module
from relayrl.trainer.main import serve
from tests.conftest import RedisServer, free_port
from tests.integration.helpers import inference_server, reward_server, with_services
from tests.integration.stack import run_stack, stack_config

pytestmark = pytest.mark.integration

STOP_STEP, STOP_MICRO, MICRO_BATCHES = 3, 2, 8  # SIGTERM during micro-batch 2 (of 8) of step 3


def _stop_mid_step(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """SIGTERM to this process during micro-batch STOP_MICRO of step STOP_STEP; that micro-batch then waits until
    the stop request has reached the learner (the returned event is set once it has, or the wait gave up)."""
    learners: list[Any] = []
    steps, micro = [0], [0]
    reached = threading.Event()
    rl_step, forward = learner_module.Learner.rl_step, learner_module.model_logprobs

    def counted_step(self: Any, *args: Any) -> Any:
        learners[:] = [self]
        steps[0] += 1
        micro[0] = 0
        return rl_step(self, *args)

    def counted_forward(*args: Any) -> torch.Tensor:
        if (steps[0], micro[0]) == (STOP_STEP, STOP_MICRO):
            os.kill(os.getpid(), signal.SIGTERM)
            stop = getattr(learners[0], "stop", None)  # the learner's stop flag, set by the trainer's handler
            if isinstance(stop, threading.Event):
                stop.wait(30)
            reached.set()
        micro[0] += 1
        return forward(*args)

    monkeypatch.setattr(learner_module.Learner, "rl_step", counted_step)
    monkeypatch.setattr(learner_module, "model_logprobs", counted_forward)
    return reached


async def _serve_until_stopped(cfg: RunConfig, model_dir: Path) -> None:
    """serve() the trainer with real inference, reward and rollout until the SIGTERM of the hook ends it."""
    async with inference_server(model_dir) as (inf_target, inf), reward_server("arithmetic") as (rew_target, _):
        cfg = with_services(cfg, inf_target, inf.weights_target, rew_target)
        stream = EpisodeStream.from_config(cfg.redis, cfg.name)
        stop = asyncio.Event()
        trainer = asyncio.create_task(serve(cfg))
        try:
            async with RolloutClients.connect(inf_target, rew_target, cfg.trainer.server.target) as clients:
                producer = RolloutProducer(
                    cfg.rollout, stream, PromptCursor(open_prompts(cfg.rollout.dataset_spec()).train, True, 0), clients
                )
                rollout = asyncio.create_task(producer.run(stop))
                try:
                    await asyncio.wait_for(trainer, timeout=300)  # returns: the stop was graceful
                finally:
                    stop.set()
                    await asyncio.wait_for(rollout, timeout=30)
        finally:
            await stream.close()


def _trained(cfg: RunConfig) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (cfg.output_dir / "trained" / "rank0.jsonl").read_text().splitlines()]


async def _stream_state(cfg: RunConfig) -> dict[str, Any]:
    """Group ids pending in the stream (delivered, not acknowledged), dropped, and the rollout's appended count."""
    stream = EpisodeStream.from_config(cfg.redis, cfg.name)
    try:
        client, keys = stream.client, stream.keys
        pending = await client.xpending_range(keys.stream, keys.group, "-", "+", 10_000)
        ids = [p["message_id"] for p in pending]
        groups = []
        for entry_id in ids:
            [(_, fields)] = await client.xrange(keys.stream, entry_id, entry_id)
            groups.append(EpisodeGroup.FromString(fields[STREAM_FIELD]).group_id)
        info = await stream.info()
        dropped = [
            k.decode()
            for reason in ("stale", "reward_error", "zero_advantage")
            for k in await client.hkeys(keys.dropped(reason))
        ]  # type: ignore[arg-type]
        appended = int(await client.hget(keys.rollout_progress, PROGRESS_APPENDED) or 0)
        return {
            "pending": groups,
            "undelivered": info.lag,
            "dropped": dropped,
            "appended": appended,
            "invalid": int(await client.hlen(keys.invalid)),
        }
    finally:
        await stream.close()


async def test_a_stop_mid_step_is_honoured_at_the_next_micro_batch_boundary_with_a_final_checkpoint_and_acks(
    tmp_path: Path,
    tiny_model_dir: Path,
    dataset_path: Path,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("RELAYRL_CONTROL_TOKEN", "c" * 32)
    monkeypatch.setenv("RELAYRL_WEIGHTS_TOKEN", "w" * 32)
    cfg = stack_config(
        tmp_path / "run",
        tiny_model_dir,
        dataset_path,
        redis_server.url,
        "trainer.total_steps=5",
        "trainer.micro_batch_size=1",
        "trainer.checkpoint.every=50",
        "trainer.checkpoint.resume=auto",
        f"trainer.server.port={free_port()}",
        "trainer.http.enabled=false",
    )
    reached = _stop_mid_step(monkeypatch)
    caplog.set_level(logging.INFO, logger="relayrl.trainer")

    await _serve_until_stopped(cfg, tiny_model_dir)  # returned normally: exit code 0

    assert reached.is_set()
    messages = [r.getMessage() for r in caplog.records]
    # the step was left at the boundary after the micro-batch the stop arrived in, far before its end
    assert any(
        f"step {STOP_STEP} abandoned at a micro-batch boundary after {STOP_MICRO + 1} of {MICRO_BATCHES} "
        "micro-batches" in m
        for m in messages
    ), messages
    assert f"stopped at step {STOP_STEP - 1} with a final checkpoint (every trained group acknowledged)" in messages
    rows = [json.loads(line) for line in cfg.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STOP_STEP))
    assert [p.name for p in sorted(cfg.checkpoint_dir.iterdir())] == [f"step_{STOP_STEP - 1:06d}"]
    trained = [g for r in _trained(cfg) for g, _ in r["groups"]]
    assert [r["step"] for r in _trained(cfg)] == list(range(1, STOP_STEP))
    held = torch.load(cfg.checkpoint_dir / f"step_{STOP_STEP - 1:06d}" / "rank0.pt", weights_only=True)
    state = await _stream_state(cfg)
    assert set(trained) <= set(held["consumed_ids"])  # the checkpoint holds every trained group ...
    assert not set(held["consumed_ids"]) & set(state["pending"])  # ... and each of them is acknowledged
    assert len(state["pending"]) >= cfg.trainer.groups_per_step  # the abandoned step's groups wait for the resume

    # resume: the abandoned step's groups are trained (or dropped as stale) now, no held group again
    abandoned = set(state["pending"])
    out = await run_stack(cfg, tiny_model_dir)

    second = [r for r in _trained(cfg) if r["resumed_from_step"] == STOP_STEP - 1]
    again = [g for r in second for g, _ in r["groups"]]
    assert [r["step"] for r in second] == list(range(STOP_STEP, cfg.trainer.total_steps + 1))
    assert not set(again) & set(trained)  # trained twice: none
    after = await _stream_state(cfg)
    assert abandoned <= set(again) | set(after["dropped"]) | set(after["pending"])  # lost: none
    effective = trained + again
    assert max(Counter(effective).values()) == 1
    assert after["appended"] == (
        len(effective) + len(after["dropped"]) + after["invalid"] + len(after["pending"]) + after["undelivered"]
    )
    assert out["trained"] == cfg.trainer.total_steps * cfg.trainer.groups_per_step
