"""In-process services on port 0 for integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import torch

from relayrl.common.grpc_utils import ServerConfig, ServerHandle
from relayrl.common.model import ModelConfig, load_model, load_tokenizer
from relayrl.inference.config import InferenceConfig
from relayrl.inference.engine import NativeEngine
from relayrl.inference.server import InferenceServicer, create_inference_server
from relayrl.reward.config import HttpConfig, RewardConfig
from relayrl.reward.http import HttpServer
from relayrl.reward.server import RewardServicer, create_reward_server


@asynccontextmanager
async def inference_server(model_dir: Path, port: int = 0, **overrides: object
                           ) -> AsyncIterator[tuple[str, InferenceServicer]]:
    cfg = InferenceConfig(server=ServerConfig(port=port), **overrides)  # type: ignore[arg-type]
    tokenizer = load_tokenizer(model_dir)
    engine = NativeEngine(load_model(ModelConfig(path=model_dir)), tokenizer, torch.device("cpu"),
                          kv_on_update=cfg.kv_on_update)
    handle, servicer = create_inference_server(cfg, engine, tokenizer, str(model_dir))
    servicer.batcher.start()
    await handle.start()
    try:
        yield f"127.0.0.1:{handle.port}", servicer
    finally:
        await handle.stop(0)
        await servicer.batcher.stop()


def function_spec(function: str | Callable[..., object]) -> str:
    """``module:function`` of a module-level function (verifier workers import it by that name)."""
    if isinstance(function, str):
        return function
    return f"{function.__module__}:{function.__qualname__}"


@asynccontextmanager
async def reward_server(function: str | Callable[..., object] = "relayrl.tasks.arithmetic:reward",
                        **overrides: object) -> AsyncIterator[tuple[str, RewardServicer]]:
    """The reward gRPC service on port 0 with its verifier pool (2 workers unless overridden)."""
    options: dict[str, object] = {"workers": 2, **overrides}
    cfg = RewardConfig(server=ServerConfig(port=0), http=HttpConfig(port=0), function=function_spec(function),
                       **options)  # type: ignore[arg-type]
    handle, servicer = create_reward_server(cfg)
    await servicer.start()
    await handle.start()
    try:
        yield f"127.0.0.1:{handle.port}", servicer
    finally:
        await stop(handle)
        await servicer.close()


@asynccontextmanager
async def reward_http(servicer: RewardServicer) -> AsyncIterator[str]:
    """The REST API of ``servicer`` on a free port: yields its base URL."""
    http = HttpServer(HttpConfig(port=0), servicer)
    await http.start()
    try:
        yield f"http://127.0.0.1:{http.port}"
    finally:
        await http.stop()


async def stop(handle: ServerHandle) -> None:
    await handle.stop(0)
