"""Entry point of the trainer service."""

from __future__ import annotations

import asyncio
import logging
import signal

from relayrl.config import RunConfig
from relayrl.trainer.service import TrainerService, create_trainer_server

log = logging.getLogger(__name__)


async def serve(cfg: RunConfig, stop: asyncio.Event | None = None) -> None:
    """Train until trainer.total_steps (then exit 0) or until SIGTERM/SIGINT."""
    cfg.model.check_exists()
    cfg.redis.require_url()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = TrainerService(cfg)
    handle = create_trainer_server(service)
    await handle.start()
    log.info("trainer status on port %d", handle.port)
    train = asyncio.create_task(service.train())
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({train, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if train.done():
            train.result()  # re-raise a training failure
            log.info("training finished after %d steps", service.step)
            await asyncio.sleep(cfg.trainer.linger_s)  # let rollout see `finished`
        else:
            log.info("stopping before the end of training (step %d)", service.step)
            train.cancel()
            await asyncio.gather(train, return_exceptions=True)
    finally:
        stopper.cancel()
        await handle.stop(cfg.trainer.server.shutdown_grace_s)
        await service.close()
