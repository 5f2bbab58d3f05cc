"""Running one sandboxed command and reaping it: stdin fed, stdout/stderr/fd 3 read with a byte cap, SIGKILL at
the wall-clock limit or the cap, and nothing it started left behind. What the command is, and the limits its
child sets up before ``exec``, come from :class:`relayrl.reward.sandbox.Sandbox`; this module only runs it."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

NAMESPACE_FAILED = 121  # exit status of a child whose network namespace could not be created
READ_CHUNK = 65536


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be set up: the program was not run."""


@dataclass(frozen=True)
class SandboxRun:
    """What a program did. ``exit_code`` is None when the sandbox killed it (timeout or output cap)."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    channel: bytes  # what the program wrote to fd 3 (a harness's result channel)
    timed_out: bool
    output_exceeded: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_exceeded

    def describe(self) -> str:
        if self.timed_out:
            return f"killed at the wall-clock limit after {self.wall_s:.1f}s"
        if self.output_exceeded:
            return "killed: output limit exceeded"
        if self.exit_code is not None and self.exit_code < 0:
            return f"killed by signal {signal.Signals(-self.exit_code).name}"
        return f"exit code {self.exit_code}"


@dataclass(frozen=True)
class Command:
    """One run to execute. ``preexec(channel_fd)`` gives the function the child runs between fork and exec (it
    makes ``channel_fd`` its fd 3); ``kill(pid)`` kills everything the run started; ``bwrap``: the command is
    bubblewrap (which exits 128 + N when the program was killed by signal N)."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    stdin: bytes
    wall_s: float
    max_output_bytes: int
    preexec: Callable[[int], Callable[[], None]]
    kill: Callable[[int], None]
    bwrap: bool


@dataclass
class _Pumped:
    outputs: dict[int, bytearray]
    timed_out: bool = False
    exceeded: bool = False


def execute(cmd: Command) -> SandboxRun:
    """Run ``cmd`` to its end, its wall-clock limit or its output cap; then kill whatever it left."""
    channel_r, channel_w = os.pipe()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd.argv,
            cwd=cmd.cwd,
            env=cmd.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(3,),
            start_new_session=True,
            preexec_fn=cmd.preexec(channel_w),
            close_fds=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        os.close(channel_r)
        raise SandboxUnavailable(f"could not start the sandbox: {exc}") from exc
    finally:
        os.close(channel_w)
    assert proc.stdout is not None and proc.stderr is not None
    stdout_fd, stderr_fd = proc.stdout.fileno(), proc.stderr.fileno()
    try:
        pumped = _pump(proc, channel_r, cmd.stdin, t0 + cmd.wall_s, cmd.max_output_bytes)
        code, timed_out = _reap(proc, cmd, pumped, t0)
    finally:
        _close(proc, channel_r)
    if code == NAMESPACE_FAILED and not cmd.bwrap and not any(pumped.outputs.values()):
        raise SandboxUnavailable(
            "could not create a network namespace for the process sandbox "
            "(unshare(2) refused); programs are never run without one"
        )
    cap, out = cmd.max_output_bytes, pumped.outputs
    return SandboxRun(
        exit_code=code,
        stdout=bytes(out[stdout_fd])[:cap],
        stderr=bytes(out[stderr_fd])[:cap],
        channel=bytes(out[channel_r])[:cap],
        timed_out=timed_out,
        output_exceeded=pumped.exceeded,
        wall_s=time.monotonic() - t0,
    )


def _pump(proc: subprocess.Popen[bytes], channel_r: int, stdin: bytes, deadline: float, cap: int) -> _Pumped:
    """Feed stdin and read stdout, stderr and the channel until the program exits (and its pipes are drained),
    the deadline passes or the output passes ``cap``."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    pumped = _Pumped({proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), channel_r: bytearray()})
    pending_in = memoryview(stdin)
    stdin_fd = proc.stdin.fileno()
    with selectors.DefaultSelector() as sel:
        for fd in pumped.outputs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if pending_in:
            os.set_blocking(stdin_fd, False)
            sel.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while len(sel.get_map()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pumped.timed_out = True
                break
            for key, _ in sel.select(min(remaining, 0.5)):
                fd = int(key.fd)  # type: ignore[arg-type]
                if fd == stdin_fd and key.events & selectors.EVENT_WRITE:
                    pending_in = _write_some(fd, pending_in)
                    if not pending_in:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                pumped.outputs[fd] += chunk
            if sum(len(v) for v in pumped.outputs.values()) > cap:
                pumped.exceeded = True
                break
            if proc.poll() is not None and not sel.select(0):
                break  # exited; a background process it left may hold the pipes open: not waited for
    return pumped


def _write_some(fd: int, pending: memoryview) -> memoryview:
    """Write what the pipe takes now; what is left (nothing once the program closed its stdin)."""
    try:
        return pending[os.write(fd, pending[:READ_CHUNK]) :]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        return pending[:0]


def _reap(proc: subprocess.Popen[bytes], cmd: Command, pumped: _Pumped, t0: float) -> tuple[int | None, bool]:
    """Kill the run if it overran, wait for it, and kill whatever it left; (exit code, timed out). The exit code
    is None when the sandbox killed it, and -N when the program died of signal N (also under bwrap)."""
    timed_out = pumped.timed_out
    if timed_out or pumped.exceeded:
        cmd.kill(proc.pid)
    try:
        code: int | None = proc.wait(timeout=max(0.1, t0 + cmd.wall_s - time.monotonic()))
    except subprocess.TimeoutExpired:  # closed its pipes but still running
        timed_out = True
        cmd.kill(proc.pid)
        code = proc.wait()
    if timed_out or pumped.exceeded:
        code = None
    elif code is not None and code > 128 and cmd.bwrap and code - 128 in signal.valid_signals():
        code = 128 - code  # bwrap exits 128 + N when the program was killed by signal N
    cmd.kill(proc.pid)  # nothing a run started outlives it
    return code, timed_out


def _close(proc: subprocess.Popen[bytes], channel_r: int) -> None:
    for stream in (proc.stdout, proc.stderr, proc.stdin):
        if stream is not None and not stream.closed:
            stream.close()
    os.close(channel_r)


def kill_uid(uid: int) -> int:
    """SIGKILL every process whose real uid is ``uid`` (a per-run uid: only that run's processes)."""
    killed = 0
    for _ in range(3):  # a process may fork while we scan: repeat until none is left
        found = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                os.kill(int(entry.name), signal.SIGKILL)
                                found += 1
                            break
            except (OSError, ValueError):
                continue
        killed += found
        if not found:
            break
    return killed
