"""A service's thread budget: torch's intra-op and inter-op threads (shared by every service section)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_THREADS = 1024


@dataclass
class ThreadsConfig:
    """How many CPU threads a service's torch may use (0: automatic).

    Automatic under ``relayrl run``: the launcher divides the cores it may use (``os.sched_getaffinity``) between
    inference and the trainer (inference half, at least 1; the trainer the rest, split between its ranks, at
    least 1) and gives reward and rollout 1 thread each, inter-op 1 everywhere; it exports ``OMP_NUM_THREADS``
    and ``MKL_NUM_THREADS`` to each child so that they hold from import. Started any other way, 0 leaves torch's
    own default (all cores, or ``OMP_NUM_THREADS`` when set)."""

    intra_op: int = field(default=0, metadata={
        "help": "torch intra-op threads (torch.set_num_threads; OMP/MKL under relayrl run); 0: automatic.",
        "ge": 0, "le": MAX_THREADS})
    interop: int = field(default=0, metadata={
        "help": "torch inter-op threads (torch.set_num_interop_threads); 0: automatic.", "ge": 0, "le": MAX_THREADS})
