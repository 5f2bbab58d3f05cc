"""In-process services on port 0 for integration tests."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from relayrl.common.grpc_utils import ServerHandle
from relayrl.common.http import HttpServer
from relayrl.common.model import load_model, load_tokenizer
from relayrl.config import RunConfig
from relayrl.config.control import ControlConfig
from relayrl.config.inference import InferenceConfig
from relayrl.config.model import ModelConfig
from relayrl.config.reward import RewardConfig
from relayrl.config.tls import TlsConfig
from relayrl.inference.http_app import create_app
from relayrl.inference.native import NativeEngine
from relayrl.inference.server import create_inference_servers
from relayrl.inference.serving import InferenceService
from relayrl.reward.http import create_app as create_reward_app
from relayrl.reward.server import RewardServicer, create_reward_server


@asynccontextmanager
async def inference_server(
    model_dir: Path,
    port: int = 0,
    weights_dir: Path | None = None,
    http: bool = False,
    server_limits: dict[str, int] | None = None,
    weights_port: int = 0,
    weights_limits: dict[str, int] | None = None,
    lora: Any = None,
    **overrides: object,
) -> AsyncIterator[tuple[str, InferenceService]]:
    """A native-engine inference server on loopback: yields the main server's target; the weights server's
    (UpdateWeights) is ``service.weights_target``, the two handles ``service.grpc_handles``. With ``http`` its REST
    API too (``service.http_port``);
    ``server_limits`` / ``weights_limits`` override fields of the main / weights gRPC server sections
    (max_receive_mib, max_authenticated_rpcs, max_streams...); ``lora`` (a LoraConfig) serves base + adapter."""
    defaults = InferenceConfig()  # the service's own limits, on loopback and free ports
    cfg = InferenceConfig(
        server=replace(defaults.server, port=port, **(server_limits or {})),
        weights_server=replace(defaults.weights_server, port=weights_port, **(weights_limits or {})),
        http=replace(defaults.http, host="127.0.0.1", port=0),
        **overrides,
    )  # type: ignore[arg-type]
    tokenizer = load_tokenizer(model_dir)
    model = load_model(ModelConfig(path=model_dir))
    if lora is not None:  # a LoraConfig: base + adapter served, as relayrl.inference.main builds it
        from relayrl.common.lora import with_lora

        model = with_lora(model, lora)
    engine = NativeEngine(
        model,
        tokenizer,
        torch.device("cpu"),
        kv_on_update=cfg.kv_on_update,
        max_batch_sequences=cfg.max_batch_sequences,
        max_prefill_tokens=cfg.max_prefill_tokens,
    )
    service = InferenceService(
        cfg,
        engine,
        tokenizer,
        str(model_dir),
        weights_dir=weights_dir,
        weights_token=ControlConfig().effective_weights_token(),
    )
    handle, weights = create_inference_servers(service)
    service.grpc_handles = (handle, weights)  # type: ignore[attr-defined]  # their admission state, for tests
    rest = HttpServer(create_app(service), cfg.http, "inference") if http else None
    await handle.start()
    await weights.start()
    if rest is not None:
        await rest.start()
        service.http_port = rest.port  # type: ignore[attr-defined]
    try:
        yield f"127.0.0.1:{handle.port}", service
    finally:
        if rest is not None:
            await rest.stop()
        await handle.stop(0)
        await weights.stop(0)
        engine.close()


def with_services(cfg: RunConfig, inference: str = "", weights: str = "", reward: str = "") -> RunConfig:
    """``cfg`` pointed at a test's own servers: inference's gRPC and weights targets and reward's (each only when
    given)."""
    inf = cfg.inference
    if inference:
        inf = replace(inf, server=replace(inf.server, address=inference))
    if weights:
        inf = replace(inf, weights_server=replace(inf.weights_server, address=weights))
    rew = replace(cfg.reward, server=replace(cfg.reward.server, address=reward)) if reward else cfg.reward
    return replace(cfg, inference=inf, reward=rew)


def function_spec(function: str | Callable[..., object]) -> str:
    """``module:function`` of a module-level function (verifier workers import it by that name)."""
    if isinstance(function, str):
        return function
    return f"{function.__module__}:{function.__qualname__}"


@asynccontextmanager
async def reward_server(
    function: str | Callable[..., object] = "relayrl.tasks.arithmetic:reward",
    tls: TlsConfig | None = None,
    code_token: str = "",
    **overrides: object,
) -> AsyncIterator[tuple[str, RewardServicer]]:
    """The reward gRPC service on port 0 with its verifier pool (2 workers unless overridden); TLS with ``tls``;
    RunCode open to ``code_token`` (empty: refused)."""
    options: dict[str, object] = {"workers": 2, **overrides}
    defaults = RewardConfig()
    cfg = RewardConfig(
        server=replace(defaults.server, port=0),
        http=replace(defaults.http, host="127.0.0.1", port=0),
        function=function_spec(function),
        **options,
    )  # type: ignore[arg-type]
    handle, servicer = create_reward_server(cfg, tls, code_token)
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
    http = HttpServer(create_reward_app(servicer), replace(RewardConfig().http, host="127.0.0.1", port=0), "reward")
    await http.start()
    try:
        yield f"http://127.0.0.1:{http.port}"
    finally:
        await http.stop()


async def stop(handle: ServerHandle) -> None:
    await handle.stop(0)


@asynccontextmanager
async def held_engine(service: Any) -> AsyncIterator[threading.Event]:
    """The engine holds before its 4th forward pass until the yielded gate is set (set on the way out too)."""
    engine = service.engine
    gate = threading.Event()

    def hold(*_: object) -> None:
        if engine.decode_steps >= 3:
            assert gate.wait(30)

    hook = engine.model.register_forward_pre_hook(hold)
    try:
        yield gate
    finally:
        gate.set()
        hook.remove()
