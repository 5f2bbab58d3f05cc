"""Entry point of the reward service."""

from __future__ import annotations

import asyncio

from relayrl.common.grpc_utils import run_until_signal
from relayrl.config import RunConfig
from relayrl.reward.api import load_reward_function
from relayrl.reward.server import create_reward_server


async def serve(cfg: RunConfig, stop: asyncio.Event | None = None) -> None:
    fn = load_reward_function(cfg.reward.function)
    handle, servicer = create_reward_server(cfg.reward, fn)
    try:
        await run_until_signal(handle, cfg.reward.server.shutdown_grace_s, stop)
    finally:
        servicer.close()
