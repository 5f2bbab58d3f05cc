"""Process lifetimes: children that die with their parent, and signals that stop a foreground program cleanly.

``relayrl run`` starts redis-server and the services as children in their own sessions (so a terminal's Ctrl-C
reaches the launcher only, which then stops them in order). So that no child outlives the launcher however it
ends, each child asks the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux), which
covers a SIGKILL of the launcher; SIGTERM, SIGHUP and SIGINT of the launcher stop the stack the way Ctrl-C does.

A service process also keeps what its start-up built out of the cyclic garbage collector's way
(:func:`freeze_heap_at_start`, :func:`start_up_done`).
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

_freeze_at_start = False  # set by freeze_heap_at_start: this process is one service


class StopRequested(Exception):
    """A stop signal arrived: the program unwinds (running its ``finally`` blocks) and exits 128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for subprocess.Popen: the child receives ``sig`` when the process that started it dies
    (also by SIGKILL). If the parent is already gone by then, the child exits at once."""
    parent = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


Handlers = dict[int, Any]


def raise_on_stop_signals() -> Handlers:
    """From now on (main thread only) SIGTERM, SIGHUP and SIGINT raise :class:`StopRequested` in the main thread.
    Returns the previous handlers, for :func:`restore_signals`."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, frame: FrameType | None) -> None:
        raise StopRequested(signum)

    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def ignore_stop_signals() -> None:
    """Ignore SIGTERM, SIGHUP and SIGINT (a shutdown in progress must not be interrupted halfway)."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def restore_signals(previous: Handlers) -> None:
    for sig, old in previous.items():
        signal.signal(sig, old)


def freeze_heap_at_start() -> None:
    """Say that this process is one service (``relayrl serve``): :func:`start_up_done` then freezes its heap.

    Once torch, transformers and a model are loaded, a trainer or inference process holds about 430 000 objects
    that live as long as it does. Python's cyclic collector walks every one of them in each full collection, about
    0.2 s on a 2-core machine: during the run, and twice more as the interpreter exits (1.0-1.4 s measured between
    a trainer's last log line and its exit). ``gc.freeze`` moves them to the permanent generation, which no
    collection walks; reference counting still frees a frozen object. A process that hosts servers among other
    work (a test, an embedding program) never calls this, so nothing it builds later is held by a freeze."""
    global _freeze_at_start
    _freeze_at_start = True


def start_up_done() -> None:
    """A service finished starting (its servers are about to report SERVING): collect the start-up's garbage
    once, then freeze what remains, where :func:`freeze_heap_at_start` was called."""
    if _freeze_at_start:
        gc.collect()
        gc.freeze()
