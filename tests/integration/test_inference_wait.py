"""The trainer's first publication waits for an inference service that is still loading its model."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from relayrl.trainer.served import served_version
from tests.conftest import free_port
from tests.integration.helpers import inference_server

pytestmark = pytest.mark.integration


async def test_served_version_waits_for_an_inference_that_comes_up_later(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="relayrl.trainer.served")
    port = free_port()

    async def go() -> tuple[bool, int]:
        asked = asyncio.create_task(served_version(f"127.0.0.1:{port}", None, wait_s=300))
        while not any("not reachable yet" in r.getMessage() for r in caplog.records):  # the first ask failed
            await asyncio.sleep(0.05)
        waiting = not asked.done()
        async with inference_server(tiny_model_dir, port=port):
            return waiting, await asked

    waiting, version = await go()

    assert waiting  # it kept asking instead of failing the trainer
    assert version == 0  # a fresh inference serves the model it loaded


async def test_served_version_gives_up_once_its_wait_is_over() -> None:
    port = free_port()  # nothing listens there

    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        await served_version(f"127.0.0.1:{port}", None, wait_s=0)
