"""Entry point of the inference service."""

from __future__ import annotations

import asyncio

import torch

from relayrl.common.control import require_credential
from relayrl.common.grpc_utils import run_until_signal
from relayrl.common.http import HttpServer
from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.pb.common_pb2 import ServingState
from relayrl.config import RunConfig
from relayrl.config.inference import EngineKind
from relayrl.config.model_fit import fit_to_model
from relayrl.inference.engine import Engine
from relayrl.inference.http_app import create_app
from relayrl.inference.server import create_inference_servers
from relayrl.inference.serving import InferenceService


def build_engine(cfg: RunConfig) -> Engine:
    ic = cfg.inference
    if ic.engine is EngineKind.VLLM:
        from relayrl.inference.vllm_engine import VllmEngine  # heavy optional import

        return VllmEngine(cfg.model, ic)
    from relayrl.inference.native import NativeEngine

    model = load_model(cfg.model)
    if cfg.model.lora.enabled:  # base + adapter served; updates then carry only the adapter
        from relayrl.common.lora import with_lora

        model = with_lora(model, cfg.model.lora)
    return NativeEngine(
        model,
        load_tokenizer(cfg.model.path),
        torch.device(cfg.model.device),
        kv_on_update=ic.kv_on_update,
        max_batch_sequences=ic.max_batch_sequences,
        max_prefill_tokens=ic.max_prefill_tokens,
    )


async def serve(cfg: RunConfig, stop: asyncio.Event | None = None) -> None:
    ic = cfg.inference
    hosts = {"inference.server.host": ic.server.host, "inference.weights_server.host": ic.weights_server.host}
    require_credential(
        cfg.control.effective_weights_token(),
        hosts,
        "a weights token (control.weights_token_env): it decides who may change the served weights",
    )
    cfg.model.check_exists()
    cfg = fit_to_model(cfg)  # the limits within the model's context (ConfigError before the model is loaded)
    engine = await asyncio.to_thread(build_engine, cfg)
    service = InferenceService(
        cfg.inference,
        engine,
        load_tokenizer(cfg.model.path),
        str(cfg.model.path),
        weights_dir=cfg.weights_dir,
        weights_token=cfg.control.effective_weights_token(),
    )
    handle, weights = create_inference_servers(service, cfg.tls)
    http = HttpServer(create_app(service), cfg.inference.http, "inference") if cfg.inference.http.enabled else None
    try:
        if http is not None:
            await http.start()
        await weights.start()  # UpdateWeights (trainer only) on its own port
        service.header.state = ServingState.SERVING_STATE_SERVING  # the engine is loaded
        await run_until_signal(handle, cfg.inference.server.shutdown_grace_s, stop)
    finally:
        await weights.stop(cfg.inference.weights_server.shutdown_grace_s)
        if http is not None:
            await http.stop()
        await asyncio.to_thread(engine.close)
