"""Logging set-up: every line names the component and the rank, and the episode/group/weight version in scope.

Two formats: ``text`` (default, one human-readable line) and ``json`` (one JSON object a line: ``time``,
``level``, ``component``, ``rank``, ``logger``, ``message``, the context fields when set, ``exc`` with a
traceback). Context travels in :mod:`contextvars`, so it follows asyncio tasks (each task has its own copy,
taken when it is created) and ``asyncio.to_thread`` calls:

    with log_context(group_id=gid, weight_version=v):
        log.info("scored")   # text: "... scored group=<gid> version=<v>"; json: "group_id", "weight_version"

``bind_log_context`` sets the same fields for the rest of the current asyncio task (one gRPC call, one group),
for code where a ``with`` block would wrap a whole function.

Records logged before the config chose the format (warnings while loading it) are held by ``records_held`` and
written by the next ``setup_logging`` in its format.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Literal

FORMAT = "%(asctime)s %(levelname)s [%(component)s rank=%(rank)s] %(name)s: %(message)s%(context_text)s"

LogFormat = Literal["text", "json"]

# context field -> its short name on text lines
CONTEXT_FIELDS = {"group_id": "group", "episode_id": "episode", "weight_version": "version"}

_context: contextvars.ContextVar[Mapping[str, str | int]] = contextvars.ContextVar(
    "relayrl_log_context", default=MappingProxyType({})
)


def _merged(group_id: str | None, episode_id: str | None, weight_version: int | None) -> Mapping[str, str | int]:
    fields = dict(_context.get())
    for key, value in (("group_id", group_id), ("episode_id", episode_id), ("weight_version", weight_version)):
        if value is not None:
            fields[key] = value
    return MappingProxyType(fields)


@contextmanager
def log_context(
    *, group_id: str | None = None, episode_id: str | None = None, weight_version: int | None = None
) -> Iterator[None]:
    """Add the given fields to every log record inside the block (nested blocks add to the outer ones)."""
    token = _context.set(_merged(group_id, episode_id, weight_version))
    try:
        yield
    finally:
        _context.reset(token)


def bind_log_context(
    *, group_id: str | None = None, episode_id: str | None = None, weight_version: int | None = None
) -> None:
    """Add the given fields to every log record for the rest of the current asyncio task (or thread)."""
    _context.set(_merged(group_id, episode_id, weight_version))


def current_log_context() -> dict[str, str | int]:
    return dict(_context.get())


class _ContextFilter(logging.Filter):
    def __init__(self, component: str, rank: int) -> None:
        super().__init__()
        self.component = component
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.component = self.component
        record.rank = self.rank
        fields = _context.get()
        record.log_context = fields
        record.context_text = "".join(f" {CONTEXT_FIELDS[k]}={v}" for k, v in fields.items())
        return True


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def records_held() -> Iterator[None]:
    """Hold the records logged in the block (e.g. while loading the config that sets the log format) until the
    next ``setup_logging``, which writes them in its format; if the block raises, write them to stderr at once."""
    root = logging.getLogger()
    held = _Held()
    root.addHandler(held)
    try:
        yield
    except BaseException:
        root.removeHandler(held)
        for record in held.records:
            if logging.lastResort is not None and record.levelno >= logging.lastResort.level:
                logging.lastResort.handle(record)
        raise


class JsonFormatter(logging.Formatter):
    """One JSON object per record; context fields only when set."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "component": getattr(record, "component", ""),
            "rank": getattr(record, "rank", 0),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, "log_context", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


def setup_logging(
    component: str, rank: int = 0, level: str = "INFO", log_file: Path | None = None, fmt: LogFormat = "text"
) -> None:
    """Configure the root logger for one process; safe to call again (replaces handlers)."""
    root = logging.getLogger()
    held = [r for h in root.handlers if isinstance(h, _Held) for r in h.records]
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    context = _ContextFilter(component, rank)
    formatter = JsonFormatter() if fmt == "json" else logging.Formatter(FORMAT)
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(context)
        root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for record in held:
        if record.levelno >= root.level:
            for handler in handlers:
                handler.handle(record)
