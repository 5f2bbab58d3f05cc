"""One gloo process group per spawned test rank, torn down so that no rank closes its connections under another."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist


@contextmanager
def gloo_group(rank: int, port: int, world_size: int = 2, timeout_s: float = 60.0) -> Iterator[None]:
    """The default process group of this rank for the block. When the block ends normally every rank meets at a
    barrier before the group is destroyed: a rank that destroys it and exits while its peer still completes the
    last collective can take the peer down with it (seen once in CI: the peer aborted with SIGABRT, "terminate
    called without an active exception"). After an error there is no barrier (the peer may never come)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
