"""Entry point of the rollout service: the rollout loop (producer.py) plus its status server (server.py)."""

from __future__ import annotations

import asyncio
import json
import logging

from relayrl.common.control import require_credential
from relayrl.common.dataset import PromptCursor, open_prompts
from relayrl.common.grpc_utils import stop_on_signals
from relayrl.common.http import HttpServer
from relayrl.common.pb.common_pb2 import ServingState
from relayrl.common.stream import EpisodeStream
from relayrl.config import RunConfig
from relayrl.config.model_fit import fit_to_model
from relayrl.rollout.clients import RolloutClients
from relayrl.rollout.producer import RolloutProducer
from relayrl.rollout.server import create_rollout_server

log = logging.getLogger(__name__)


async def serve(cfg: RunConfig, stop: asyncio.Event | None = None) -> None:
    """Produce groups until the trainer finishes (then wait) or until SIGTERM/SIGINT (or ``stop``)."""
    cfg = fit_to_model(cfg)  # the limits within the model's context, when its config.json is here
    rc = cfg.rollout
    cfg.redis.require_url()
    hosts = {"rollout.server.host": rc.server.host, **({"rollout.http.host": rc.http.host} if rc.http.enabled else {})}
    require_credential(cfg.control.effective_token(), hosts, "a control token (control.token_env)")
    rows = open_prompts(rc.dataset_spec()).train
    stop = stop_on_signals(stop)
    stream = EpisodeStream.from_config(cfg.redis, cfg.name)
    async with RolloutClients.connect(
        [e.address for e in cfg.inference.replica_endpoints()],
        cfg.reward.server.target,
        cfg.trainer.server.target,
        cfg.tls,
        code_token=cfg.control.effective_code_token(),
        trainer_token=cfg.control.effective_token(),
    ) as clients:
        producer = RolloutProducer(
            rc,
            stream,
            PromptCursor(rows, rc.shuffle, rc.seed),
            clients,
            redis_retry_s=cfg.redis.retry_s,
            model_path=cfg.model.path,
            score_batch_max=min(rc.score_batch_max, cfg.reward.max_batch),
            generate_batch_samples=cfg.inference.max_samples_per_request,
        )
        handle, servicer = create_rollout_server(producer, cfg)
        http = HttpServer(servicer.http_app(), rc.http, "rollout") if rc.http.enabled else None
        await handle.start()
        if http is not None:
            await http.start()
        servicer.header.state = ServingState.SERVING_STATE_SERVING
        log.info("rollout serving status on port %d; %d prompts from %s", handle.port, len(rows), rc.dataset)
        try:
            await producer.run(stop)
            if not stop.is_set():
                log.info("trainer finished; rollout waits for shutdown")
                await stop.wait()
        finally:
            if http is not None:
                await http.stop()
            await handle.stop(rc.server.shutdown_grace_s)
            await stream.close()
            cfg.output_dir.mkdir(parents=True, exist_ok=True)
            (cfg.output_dir / "rollout_state.json").write_text(json.dumps(producer.state(), indent=1) + "\n")
            log.info("rollout state: %s", producer.state())
