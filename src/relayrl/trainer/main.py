"""Entry point of the trainer service (one process per rank; several ranks run under torchrun)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

from relayrl.common.control import require_credential
from relayrl.common.http import HttpServer
from relayrl.common.probe import WeightVerificationError
from relayrl.config import RunConfig
from relayrl.config.model_fit import fit_to_model
from relayrl.config.trainer import AfterFinish
from relayrl.config.typed import ConfigError
from relayrl.trainer.collectives import Collectives, CollectiveTimeout
from relayrl.trainer.runtime import Trainer
from relayrl.trainer.server import create_trainer_server

log = logging.getLogger(__name__)


def init_collectives(cfg: RunConfig) -> Collectives:
    """Create the process group explicitly (gloo on CPU, NCCL on CUDA) when torchrun started several ranks."""
    tc = cfg.trainer
    world = int(os.environ.get("WORLD_SIZE", "1"))
    record = cfg.output_dir / "collectives" if tc.distributed.record_collectives else None
    if world != tc.distributed.world_size:
        from relayrl.config.typed import ConfigError

        raise ConfigError(
            "trainer.distributed.world_size",
            tc.distributed.world_size,
            f"must equal the number of processes started (WORLD_SIZE={world}); use torchrun",
        )
    if world == 1:
        return Collectives(None, tc.distributed.collective_timeout_s, record)
    backend = "gloo"
    if cfg.model.device.startswith("cuda"):
        # each rank drives the GPU of its local rank; CPU tensors (step statistics, object collectives) go over
        # gloo, CUDA tensors (gradients, weights) over NCCL
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, timeout=timedelta(seconds=tc.distributed.collective_timeout_s))
    group = dist.group.WORLD
    assert group is not None
    return Collectives(group, tc.distributed.collective_timeout_s, record, group_name="world")


async def _stop_training(trainer: Trainer, train: asyncio.Task[None], force: asyncio.Event) -> None:
    """A stop before the end: once RL steps have begun, graceful (the loop stops at its next safe point, a
    micro-batch boundary or a read of groups, and writes a final checkpoint whose groups it acknowledges); before
    that (start-up, warm-up: nothing consumed yet) at once. A second signal, or the graceful stop outlasting its
    deadline (what the launcher waits: relayrl.config.trainer.graceful_stop_s, over this rank's measured steps),
    cancels it: a checkpoint already being written still completes, nothing after it runs."""
    step = trainer.progress.step
    if trainer.loop.stepping:
        budget = trainer.loop.stop_budget()
        log.info(
            "stop requested at step %d: stopping at the next micro-batch boundary, then a final checkpoint, "
            "within %.1fs (%s; a second signal stops at once)",
            step,
            budget.deadline_s,
            budget.bound,
        )
        trainer.loop.request_stop()
        forced = asyncio.create_task(force.wait())
        await asyncio.wait({train, forced}, timeout=budget.deadline_s, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if train.done():
            train.result()  # a failure of the final checkpoint is loud
            return
        log.warning(
            "%s: stopping at once, without a final checkpoint (step %d)",
            "second stop signal"
            if force.is_set()
            else f"the graceful stop did not end within {budget.deadline_s:.1f}s",
            trainer.progress.step,
        )
    else:
        log.info("stopping before the end of training (step %d)", step)
    train.cancel()
    await asyncio.gather(train, return_exceptions=True)


async def serve(cfg: RunConfig, stop: asyncio.Event | None = None) -> None:
    """Train until trainer.total_steps (then exit 0) or until SIGTERM/SIGINT. Rank 0 serves the status API."""
    cfg.model.check_exists()
    cfg = fit_to_model(cfg)  # the limits within the model's context (ConfigError before the model is loaded)
    cfg.trainer.eval.check_exists()
    cfg.redis.require_url()
    tc = cfg.trainer
    hosts = {"trainer.server.host": tc.server.host, **({"trainer.http.host": tc.http.host} if tc.http.enabled else {})}
    require_credential(cfg.control.effective_token(), hosts, "a control token (control.token_env)")
    if not cfg.control.effective_weights_token():
        raise ConfigError(
            cfg.control.weights_token_env,
            "",
            "the trainer needs the weights token: inference accepts weight updates only with it",
        )
    stop, force = stop or asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # the first asks for a graceful stop, a second one stops at once
        loop.add_signal_handler(sig, lambda: (force if stop.is_set() else stop).set())
    coll = init_collectives(cfg)
    trainer = Trainer(cfg, coll)
    handle, servicer = create_trainer_server(trainer) if coll.rank == 0 else (None, None)
    http = HttpServer(servicer.http_app(), tc.http, "trainer") if servicer is not None and tc.http.enabled else None
    if handle is not None:
        await handle.start()
        log.info("trainer status on port %d (world size %d)", handle.port, coll.world_size)
    if http is not None:
        await http.start()
    train = asyncio.create_task(trainer.train())
    watchdog = asyncio.create_task(trainer.watch_inference()) if coll.rank == 0 else None
    stopper = asyncio.create_task(stop.wait())
    borrower = asyncio.create_task(trainer.borrow_idle_cores()) if trainer.cores is not None else None
    try:
        await asyncio.wait({train, stopper} | ({watchdog} if watchdog else set()), return_when=asyncio.FIRST_COMPLETED)
        if watchdog is not None and watchdog.done() and not train.done():
            train.cancel()
            await asyncio.gather(train, return_exceptions=True)
            watchdog.result()  # a verification failure of a re-push stops the trainer loudly
        if train.done():
            try:
                train.result()  # re-raise a training failure
            except WeightVerificationError as exc:
                log.critical("%s; stopping (the served weights are not the trained ones)", exc)
                raise
            except CollectiveTimeout as exc:
                # gloo's teardown would wait for the peer up to the process-group timeout again: exit hard
                log.critical("%s", exc)
                logging.shutdown()
                os._exit(3)
            log.info("training finished after %d steps", trainer.progress.step)
            if cfg.trainer.after_finish is AfterFinish.STAY:
                log.info("the run is finished; serving its status until stopped (trainer.after_finish stay)")
                await stopper
            else:
                await asyncio.sleep(cfg.trainer.linger_s)  # let rollout see `finished`
        else:
            if watchdog is not None:
                watchdog.cancel()  # no re-push while stopping
            await _stop_training(trainer, train, force)
    finally:
        stopper.cancel()
        if borrower is not None:
            borrower.cancel()
        if watchdog is not None:
            watchdog.cancel()
        if http is not None:
            await http.stop()
        if handle is not None:
            await handle.stop(cfg.trainer.server.shutdown_grace_s)
        await trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
