"""The checkpoint folder's layout, shared by the trainer (which writes it) and the launcher and status (which read
it): ``<output_dir>/checkpoints/step_NNNNNN/`` holds a complete checkpoint once ``trainer_state.pt`` is in it and
its name has no ``.tmp`` suffix (it is renamed into place when durable)."""

from __future__ import annotations

from pathlib import Path

STATE_FILE = "trainer_state.pt"


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / STATE_FILE).is_file()
    )


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))
