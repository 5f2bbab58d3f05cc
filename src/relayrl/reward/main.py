"""Entry point of the reward service: the verifier pool, the gRPC server and the REST API, on one event loop."""

from __future__ import annotations

import asyncio

from relayrl.common.grpc_utils import run_until_signal
from relayrl.common.http import HttpServer
from relayrl.config import RunConfig
from relayrl.reward.http import create_app
from relayrl.reward.scorer import with_run_values
from relayrl.reward.server import create_reward_server


def inference_url(cfg: RunConfig) -> str:
    """The OpenAI-compatible base URL of the run's (first) inference replica: its gRPC host, its HTTP port."""
    host = cfg.inference.replica_endpoints()[0].address.rpartition(":")[0]
    return f"http://{host}:{cfg.inference.http.port}/v1"


async def serve(cfg: RunConfig, stop: asyncio.Event | None = None) -> None:
    reward = with_run_values(cfg.reward, {"inference_url": inference_url(cfg)})  # a judge on the run's inference
    handle, servicer = create_reward_server(reward, cfg.tls, cfg.control.effective_code_token())
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
