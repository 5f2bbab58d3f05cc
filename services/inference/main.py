"""Entry point of the inference service."""

from __future__ import annotations

import asyncio

import torch

from relayrl.common.grpc_utils import run_until_signal
from relayrl.common.model import load_model, load_tokenizer
from relayrl.config import RunConfig
from relayrl.inference.engine import NativeEngine
from relayrl.inference.server import create_inference_server


async def serve(cfg: RunConfig, stop: asyncio.Event | None = None) -> None:
    cfg.model.check_exists()
    tokenizer = load_tokenizer(cfg.model.path)
    model = load_model(cfg.model)
    engine = NativeEngine(model, tokenizer, torch.device(cfg.model.device), kv_on_update=cfg.inference.kv_on_update)
    handle, servicer = create_inference_server(cfg.inference, engine, tokenizer, str(cfg.model.path))
    servicer.batcher.start()
    try:
        await run_until_signal(handle, cfg.inference.server.shutdown_grace_s, stop)
    finally:
        await servicer.batcher.stop()
