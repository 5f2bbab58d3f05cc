"""A run's services in the test's own process: inference, reward, the trainer with its gRPC server, and rollout,
against a real redis-server, until the trainer finishes; what they counted, logged and wrote, for the tests to
check the books."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from relayrl.client.inference_pool import replica_counts
from relayrl.common.dataset import PromptCursor, open_prompts
from relayrl.common.stream import EpisodeStream
from relayrl.config import RunConfig, load_run_config
from relayrl.config.inference import ReplicaEndpoint
from relayrl.config.publication import WeightTransport
from relayrl.rollout.clients import RolloutClients
from relayrl.rollout.producer import RolloutProducer
from relayrl.trainer.runtime import Trainer
from relayrl.trainer.server import create_trainer_server
from tests.integration.helpers import inference_server, reward_server, with_services


def stack_config(tmp: Path, model: Path, data: Path, redis_url: str, *overrides: str) -> RunConfig:
    """A small run's config (4 steps of 2 groups of 4, 3 new tokens, checkpoints every 2 steps) under ``tmp``;
    ``overrides`` (KEY=VALUE) last."""
    return load_run_config(
        None,
        [
            f"model.path={model}",
            f"rollout.dataset={data}",
            f"redis.url={redis_url}",
            f"output_dir={tmp}",
            "trainer.total_steps=4",
            "trainer.groups_per_step=2",
            "rollout.group_size=4",
            "rollout.max_new_tokens=3",
            "trainer.server.port=0",
            "trainer.checkpoint.every=2",
            "trainer.linger_s=0",
            "trainer.sft.batch_size=8",
            *overrides,
        ],
    )


def _with_replicas(
    cfg: RunConfig, replicas: list[tuple[str, Any]], transports: Sequence[WeightTransport | None] = ()
) -> RunConfig:
    """``cfg`` with the inference servers ``replicas`` (target, service) as inference.endpoints, when several, each
    with its own weight transport from ``transports`` (unset: the publication's)."""
    if len(replicas) == 1:
        return cfg
    kinds = [*transports, *[None] * (len(replicas) - len(transports))]
    endpoints = [ReplicaEndpoint(t, s.weights_target, kind) for (t, s), kind in zip(replicas, kinds, strict=True)]
    return replace(cfg, inference=replace(cfg.inference, endpoints=endpoints))


def _tensorboard(cfg: RunConfig) -> dict[str, list[tuple[int, float]]]:
    """The run's TensorBoard scalars: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cfg.output_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


async def run_stack(
    cfg: RunConfig,
    model_dir: Path,
    reward_function: str = "arithmetic",
    inject: list[dict[bytes, bytes]] | None = None,
    timeout_s: float = 120,
    reward_target: str = "",
    inference_replicas: int = 1,
    during: Callable[[list[Any]], Awaitable[None]] | None = None,
    replica_transports: Sequence[WeightTransport | None] = (),
) -> dict[str, Any]:
    """Inference, reward, trainer and rollout in this process until the trainer finishes; ``inject``: entries
    XADDed to the stream before anything else (not produced by rollout); ``reward_target``: the reward replicas the
    run uses (the test's own), else one in this process; ``inference_replicas``: inference servers, listed in
    inference.endpoints when more than one, each on its transport of ``replica_transports`` (they read shared files
    from the run's weights directory); ``during``: run beside the run with the inference services."""
    async with contextlib.AsyncExitStack() as stack:
        replicas = [
            await stack.enter_async_context(inference_server(model_dir, weights_dir=cfg.weights_dir))
            for _ in range(inference_replicas)
        ]
        (inf_target, inf), services = replicas[0], [service for _, service in replicas]
        rew_target = reward_target or (await stack.enter_async_context(reward_server(reward_function)))[0]
        cfg = _with_replicas(
            with_services(cfg, inf_target, inf.weights_target, rew_target), replicas, replica_transports
        )
        trainer = Trainer(cfg)
        handle, _ = create_trainer_server(trainer)
        await handle.start()
        stream = EpisodeStream.from_config(cfg.redis, cfg.name)
        for fields in inject or []:
            await stream.client.xadd(stream.keys.stream, fields)  # type: ignore[arg-type]
        stop = asyncio.Event()
        try:
            addresses = [e.address for e in cfg.inference.replica_endpoints()]
            async with RolloutClients.connect(addresses, rew_target, f"127.0.0.1:{handle.port}") as clients:
                producer = RolloutProducer(
                    cfg.rollout, stream, PromptCursor(open_prompts(cfg.rollout.dataset_spec()).train, True, 0), clients
                )
                rollout = asyncio.create_task(producer.run(stop))
                beside = asyncio.create_task(during(services)) if during is not None else None
                try:
                    await asyncio.wait_for(trainer.train(), timeout=timeout_s)
                    if beside is not None:
                        await beside
                except BaseException:
                    stop.set()
                    await asyncio.wait_for(rollout, timeout=30)
                    raise
                await asyncio.wait_for(rollout, timeout=30)  # rollout ends once the trainer says finished
            info = await stream.info()
            dead = [f[b"reason"].decode() for _, f in await stream.client.xrange(stream.keys.dead_letter, "-", "+")]
        finally:
            await handle.stop(0)
            await trainer.close()
            await stream.close()
    rows = [json.loads(line) for line in cfg.metrics_path.read_text().splitlines()]
    return {
        "produced": producer.groups_produced,
        "trained": trainer.progress.groups_trained,
        "tensorboard": _tensorboard(cfg),
        "dropped": trainer.progress.groups_dropped_stale,
        "pending": info.pending + info.lag,
        "dropped_reward_error": trainer.progress.groups_dropped_reward_error,
        "dropped_zero_advantage": trainer.progress.groups_dropped_zero_advantage,
        "episodes_dropped_zero_advantage": trainer.progress.episodes_dropped_zero_advantage,
        "invalid": trainer.progress.groups_invalid,
        "episodes_invalid": trainer.progress.episodes_invalid,
        "dead_letters": dead,
        "episodes_dropped_reward_error": trainer.progress.episodes_dropped_reward_error,
        "episodes_reward_errors": producer.episodes_reward_errors,
        "length": info.length,
        "inference_version": inf.engine.version,
        "inference_versions": [service.engine.version for service in services],
        "inference_services": services,
        "replica_counts": replica_counts(producer.clients.inference),
        "rows": [r for r in rows if r.get("phase") != "sft"],
        "sft_rows": [r for r in rows if r.get("phase") == "sft"],
    }
