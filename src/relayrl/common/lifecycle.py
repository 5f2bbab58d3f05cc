"""Process lifetimes: children that die with their parent, and signals that stop a foreground program cleanly.

``relayrl run`` starts redis-server and the services as children in their own sessions (so a terminal's Ctrl-C
reaches the launcher only, which then stops them in order). So that no child outlives the launcher however it
ends, each child asks the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux), which
covers a SIGKILL of the launcher; SIGTERM, SIGHUP and SIGINT of the launcher stop the stack the way Ctrl-C does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


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
