"""Applying a service's thread budget (relayrl.config.threads) at start-up, before any torch work.

``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` (which the local launcher exports to each child, see
:func:`thread_env`) size the OpenMP and MKL pools when torch is imported; :func:`apply_threads` pins the process
to its ``cpus`` (:func:`pin_cpus`), then sets torch's own counts from the config. A torch-free service (reward,
rollout) is pinned and logs what its environment says.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from relayrl.config.threads import ThreadsConfig
from relayrl.config.typed import ConfigError

log = logging.getLogger(__name__)

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def thread_env(intra_op: int) -> dict[str, str]:
    """The environment a child needs so that ``intra_op`` threads hold from import (empty for 0: automatic)."""
    return {name: str(intra_op) for name in THREAD_ENV} if intra_op > 0 else {}


def apply_threads(cfg: ThreadsConfig, service: str) -> tuple[int, int] | None:
    """Set torch's intra-op and inter-op threads from ``cfg`` (0 keeps torch's choice) and log the effective
    counts. Returns them, or None when torch is not loaded (nothing to set). Call before any torch work: inter-op
    threads can be set only once, before inter-op parallel work starts; a later attempt is logged, not fatal."""
    # the trainer's borrowed cores (relayrl.trainer.cores), checked before pinning narrows what the process may use
    require_usable(getattr(cfg, "borrow_cpus", []), f"{service}.threads.borrow_cpus")
    pinned = pin_cpus(cfg.cpus, f"{service}.threads.cpus")
    if pinned is not None:
        log.info("%s runs on CPUs %s", service, ",".join(map(str, sorted(pinned))))
    torch = sys.modules.get("torch")
    if torch is None:
        log.info("%s threads: no torch loaded (OMP_NUM_THREADS=%s)", service, os.environ.get("OMP_NUM_THREADS", "-"))
        return None
    if cfg.intra_op > 0:
        torch.set_num_threads(cfg.intra_op)
    if cfg.interop > 0 and torch.get_num_interop_threads() != cfg.interop:
        try:
            torch.set_num_interop_threads(cfg.interop)
        except RuntimeError as exc:  # inter-op work already started (e.g. in-process tests): keep what runs
            log.warning("%s: inter-op threads stay %d: %s", service, torch.get_num_interop_threads(), exc)
    counts = int(torch.get_num_threads()), int(torch.get_num_interop_threads())
    log.info(
        "%s threads: intra-op %d, inter-op %d (OMP_NUM_THREADS=%s)",
        service,
        *counts,
        os.environ.get("OMP_NUM_THREADS", "-"),
    )
    return counts


def pin_cpus(cpus: Sequence[int], field: str, pid: int | None = None, check: bool = True) -> set[int] | None:
    """Run every thread of this process (or of process ``pid``), and each thread or child process it starts later,
    on ``cpus`` only; empty: nothing changes (None). A CPU this process may not use now is a :class:`ConfigError`
    naming ``field``, unless ``check`` is false (a pinned process widening itself again: checked at start-up)."""
    if not cpus:
        return None
    if check:
        require_usable(cpus, field)
    wanted = set(cpus)
    # sched_setaffinity of a pid pins that one thread only
    for tid in os.listdir(f"/proc/{'self' if pid is None else pid}/task"):
        try:
            os.sched_setaffinity(int(tid), wanted)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return wanted


def require_usable(cpus: Sequence[int], field: str) -> None:
    """A CPU this process may not use now is a :class:`ConfigError` naming ``field``."""
    usable = os.sched_getaffinity(0)
    if not set(cpus) <= usable:
        raise ConfigError(field, list(cpus), f"must be CPUs this process may use: {sorted(usable)}")


def automatic_cpus(cores: Sequence[int], trainer_ranks: int = 1) -> dict[str, list[int]]:
    """The local launcher's pinning of ``cores`` (usable CPU ids), matching :func:`automatic_division`: the trainer
    (all its ranks) on the last cores, as many as its threads in all; inference, reward and rollout on the others.
    Nothing is pinned (empty lists) with fewer than 2 cores: there is nothing to divide."""
    cores = sorted(cores)
    split = automatic_division(len(cores), trainer_ranks)["inference"] if len(cores) >= 2 else 0
    generation, training = cores[:split], (cores[split:] if split else [])
    return {"inference": generation, "reward": list(generation), "rollout": list(generation), "trainer": training}


def automatic_division(cores: int, trainer_ranks: int = 1) -> dict[str, int]:
    """The local launcher's intra-op threads per service for ``cores`` usable cores: inference half (at least 1),
    the trainer the rest split between its ranks (at least 1 each), reward and rollout 1."""
    inference = max(1, cores // 2)
    trainer = max(1, (cores - inference) // max(trainer_ranks, 1))
    return {"inference": inference, "trainer": trainer, "reward": 1, "rollout": 1}
