"""The tests' one way to wait for something a process or server reaches on its own: poll a condition with a bound,
never sleep a fixed time and hope. :func:`until` (async) says whether the condition held in time; :func:`wait_for`
(sync) fails naming what never happened, and at once, with the process's output, if the process that should
bring it about exited."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable


async def until(condition: Callable[[], object], timeout_s: float = 30.0, poll_s: float = 0.01) -> bool:
    """Whether ``condition()`` became true within ``timeout_s`` (polled every ``poll_s``, yielding the loop)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return bool(condition())
        await asyncio.sleep(poll_s)
    return True


def wait_for(
    condition: Callable[[], object],
    what: str,
    timeout_s: float = 240.0,
    alive: subprocess.Popen[str] | None = None,
    poll_s: float = 0.2,
) -> None:
    """Return once ``condition()`` is true; AssertionError naming ``what`` after ``timeout_s``, or as soon as
    ``alive`` (the process expected to bring it about) has exited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if alive is not None and alive.poll() is not None:
            output = alive.stdout.read() if alive.stdout else ""
            raise AssertionError(f"{what}: the process exited with {alive.returncode} first\n{output[-5000:]}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)
