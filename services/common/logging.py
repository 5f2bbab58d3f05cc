"""Logging set-up: every line names the component and the rank."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s [%(component)s rank=%(rank)s] %(name)s: %(message)s"


class _ContextFilter(logging.Filter):
    def __init__(self, component: str, rank: int) -> None:
        super().__init__()
        self.component = component
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.component = self.component
        record.rank = self.rank
        return True


def setup_logging(component: str, rank: int = 0, level: str = "INFO", log_file: Path | None = None) -> None:
    """Configure the root logger for one process; safe to call again (replaces handlers)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    context = _ContextFilter(component, rank)
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.addFilter(context)
        root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
