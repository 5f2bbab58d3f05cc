"""A stop that arrives while a checkpoint is being saved lets it finish and acknowledge its groups, so no group is
both trained (in the durable checkpoint) and pending (unacknowledged) in the run's books."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from relayrl.trainer.runtime import Trainer
from tests.conftest import RedisServer
from tests.integration.stack import stack_config

pytestmark = pytest.mark.integration


async def test_a_stop_during_a_checkpoint_waits_for_its_acknowledgement_then_stops(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    cfg = stack_config(tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url)
    events: list[str] = []

    async def go() -> bool:
        trainer = Trainer(cfg)
        saving, proceed = asyncio.Event(), asyncio.Event()

        async def save_and_ack(step: int, weight_version: int, counters: dict[str, Any]) -> None:
            events.append("saving")
            saving.set()
            await proceed.wait()  # the checkpoint is being written when the stop comes
            events.append("durable and acknowledged")

        trainer.loop.checkpoints.save_and_ack = save_and_ack  # type: ignore[method-assign]
        try:
            task = asyncio.create_task(trainer.loop.checkpoint_and_ack())
            await saving.wait()
            task.cancel()  # what the trainer's main does on SIGTERM
            await asyncio.sleep(0)
            proceed.set()
            try:
                await task
            except asyncio.CancelledError:
                return True
            return False
        finally:
            await trainer.close()

    cancelled = await go()

    assert cancelled  # the stop still stops the trainer
    assert events == ["saving", "durable and acknowledged"]  # but only once the checkpoint's acks are done
