"""Files that hold secrets: written readable by their owner only (0600) and replaced atomically, so no reader
ever sees one half-written or with wider permissions."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 (also over an existing, wider file), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an existing tmp file keeps its old mode through O_CREAT
        f.write(text)
    os.replace(tmp, path)
