"""What inference serves, as the trainer sees it: a replica's version (:func:`served_version`, also the floor of a
restarted trainer's first allocation), and rank 0's watchdog that pushes the current weights again to a replica that
serves an older version (:func:`watch_inference`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from relayrl.client import InferenceClient
from relayrl.config.tls import TlsConfig

log = logging.getLogger(__name__)

UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # inference not (yet) up


class Republisher(Protocol):
    """What the watchdog uses of the publication (relayrl.trainer.publication.VersionPublication)."""

    weight_version: int
    inference_targets: list[str]

    @property
    def publishing(self) -> bool: ...

    async def lagging_replicas(self) -> list[str]: ...

    async def allocate_and_push(self, policy_step: int, floor: int, only: list[str] | None = None) -> int: ...


async def served_version(target: str, tls: TlsConfig | None, wait_s: float = 0.0) -> int:
    """The version inference at ``target`` serves now. While it cannot be reached (UNAVAILABLE or no answer in
    time: it may still be loading its model, which takes minutes for a large one or for vLLM), ask again for up to
    ``wait_s`` seconds; then, or on any other error, RuntimeError."""
    deadline = time.monotonic() + wait_s
    while True:
        async with InferenceClient(target, timeout_s=10.0, retries=4, backoff_s=0.5, tls=tls) as inference:
            try:
                return int((await inference.status()).weight_version)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code not in UNREACHABLE or time.monotonic() >= deadline:
                    raise RuntimeError(f"inference status unavailable: {code.name}") from exc
        log.info(
            "inference at %s not reachable yet (%s): asking again, for up to %.0fs more",
            target,
            code.name,
            deadline - time.monotonic(),
        )
        await asyncio.sleep(1.0)


async def watch_inference(
    publication: Republisher,
    current_step: Callable[[], int],
    finished: Callable[[], bool],
    interval_s: float = 2.0,
) -> None:
    """Rank 0: if an inference replica serves an older version than the trainer's (it restarted from disk, joined
    late, or missed a push), push the current weights again under a fresh version of the same policy step, so it
    never serves old weights for long.
    Rank-local (no collective): other ranks measure staleness through the lineage, where the re-pushed version
    and the current one are the same step."""
    while True:
        await asyncio.sleep(interval_s)
        version = publication.weight_version
        if version == 0 or publication.publishing:
            continue
        lagging = await publication.lagging_replicas()
        # a publication that began while the replicas were asked makes them look behind: it reaches them itself
        if not lagging or finished() or publication.publishing or publication.weight_version != version:
            continue
        log.warning(
            "inference %s serves a version older than %d or missed a push: pushing the current weights again",
            ", ".join(lagging),
            publication.weight_version,
        )
        try:
            only = lagging if len(lagging) < len(publication.inference_targets) else None
            await publication.allocate_and_push(current_step(), publication.weight_version, only)
        except RuntimeError as exc:  # inference went away again: try at the next tick
            log.warning("re-push failed: %s", exc)
