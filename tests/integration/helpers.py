"""In-process services on port 0 for integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import torch

from relayrl.common.grpc_utils import ServerConfig, ServerHandle
from relayrl.common.model import ModelConfig, load_model, load_tokenizer
from relayrl.inference.config import InferenceConfig
from relayrl.inference.engine import NativeEngine
from relayrl.inference.server import InferenceServicer, create_inference_server
from relayrl.reward.api import RewardFn
from relayrl.reward.config import RewardConfig
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


@asynccontextmanager
async def reward_server(fn: RewardFn, **overrides: object) -> AsyncIterator[tuple[str, RewardServicer]]:
    cfg = RewardConfig(server=ServerConfig(port=0), **overrides)  # type: ignore[arg-type]
    handle, servicer = create_reward_server(cfg, fn)
    await handle.start()
    try:
        yield f"127.0.0.1:{handle.port}", servicer
    finally:
        await stop(handle)
        servicer.close()


async def stop(handle: ServerHandle) -> None:
    await handle.stop(0)
