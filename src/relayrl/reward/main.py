"""Entry point of the reward service: the verifier pool, the gRPC server and the REST API, on one event loop."""

from __future__ import annotations

import asyncio

from relayrl.common.grpc_utils import run_until_signal
from relayrl.common.http import HttpServer
from relayrl.config import RunConfig
from relayrl.reward.http import create_app
from relayrl.reward.server import create_reward_server


async def serve(cfg: RunConfig, stop: asyncio.Event | None = None) -> None:
    handle, servicer = create_reward_server(cfg.reward, cfg.tls, cfg.control.effective_code_token())
    await servicer.start()  # workers ready before health says SERVING
    http = HttpServer(create_app(servicer), cfg.reward.http, "reward") if cfg.reward.http.enabled else None
    try:
        if http is not None:
            await http.start()
        await run_until_signal(handle, cfg.reward.server.shutdown_grace_s, stop)
    finally:
        if http is not None:
            await http.stop()
        await servicer.close()
