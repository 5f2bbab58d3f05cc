"""The dashboard's HTTP server: one self-contained page and the JSON it polls.

The standard library's threading HTTP server is enough here: two read-only GET routes over a file, no async
code to share a loop with, the bound port known before serving (so ``--port 0`` prints an exact URL), and
Ctrl-C ends ``serve_forever`` as a plain KeyboardInterrupt.

``GET /api/metrics?offset=N&file=ID`` returns the training-step rows of ``metrics.jsonl`` from byte ``N`` on,
the offset to ask for next and the file's identity: the page polls with both and receives only new rows. A
last line still being written (no newline yet) is left for the next poll; a replaced file (a fresh run in the
same folder) or a shorter one sends everything again with ``reset`` set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import socket
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from relayrl.common.http import host_allowed
from relayrl.common.metrics_row import RlRow, format_books, parse_row

log = logging.getLogger(__name__)

# The fields of a training-step row (relayrl.common.metrics_row.RlRow) that the page draws or shows; the rest of
# a row is not sent, nor a field the row lacks (written by an older version, or null).
FIELDS = (
    "step",
    "time_s",
    "weight_version",
    "reward_mean",
    "reward_std",
    "staleness_mean",
    "staleness_max",
    "episodes_per_s",
    "tokens",
    "step_time_s",
    "episodes_dropped_stale",
    "queue_lag",
    "queue_pending",
    "turns_mean",
    "tool_calls_mean",
    "tool_errors",
)
assert set(FIELDS) <= {f.name for f in dataclasses.fields(RlRow)}, "FIELDS names a field RlRow does not have"
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class MetricsChunk:
    rows: list[dict[str, Any]]  # training steps only (supervised warm-up rows are left out), FIELDS only
    offset: int  # byte offset just after the last complete line read: where the next read starts
    file_id: str  # identity of the file read ("" when there is none): another one means a new run
    reset: bool = False  # the rows start from the beginning of the file, not from the offset asked for
    bad_lines: int = 0  # complete lines that were not a JSON object (skipped)


def _json_safe(value: Any) -> Any:
    """NaN and infinities become null: the page's JSON.parse rejects them."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def read_metrics_chunk(path: Path, offset: int = 0, file_id: str = "") -> MetricsChunk:
    """The step rows of the complete lines of ``path`` after byte ``offset`` of the file ``file_id``.

    A file other than ``file_id`` (when given), or shorter than ``offset``, is read from its start with
    ``reset`` set. A missing file reads as empty."""
    try:
        with path.open("rb") as f:
            st = os.fstat(f.fileno())
            # inode numbers are reused at once after an unlink: the first line (its time_s, its values) tells
            # a new run's file from the old one
            first = f.readline(4096)
            current = (
                f"{st.st_ino}-{hashlib.blake2b(first, digest_size=8).hexdigest()}"
                if first.endswith(b"\n")
                else f"{st.st_ino}-"
            )
            reset = offset > st.st_size or (bool(file_id) and file_id != current)
            start = 0 if reset else offset
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return MetricsChunk([], 0, "", reset=offset > 0 or bool(file_id))
    end = data.rfind(b"\n") + 1  # a torn last line stays unread until its newline arrives
    rows: list[dict[str, Any]] = []
    bad = 0
    for line in data[:end].splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if not isinstance(row, dict):
            bad += 1
            continue
        step = parse_row(row)
        if isinstance(step, RlRow):  # warm-up rows and rows without a step are not drawn
            rows.append(page_row(step))
    if bad:
        log.warning("%s: skipped %d lines that are not JSON objects", path, bad)
    return MetricsChunk(rows, start + end, current, reset, bad)


def page_row(row: RlRow) -> dict[str, Any]:
    """The part of a row the page gets: FIELDS the row has, non-finite numbers as null."""
    return {k: _json_safe(getattr(row, k)) for k in FIELDS if k not in row.missing}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or being written
        return None
    return data if isinstance(data, dict) else None


def _max_staleness(config_path: Path) -> int | None:
    import yaml

    try:
        data = yaml.safe_load(config_path.read_text()) or {}
        value = data.get("rollout", {}).get("max_staleness")
        return int(value) if value is not None else None
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return None


class DashboardServer:
    """Serves the page and ``/api/metrics`` for one run folder until ``close``."""

    def __init__(
        self, run_dir: Path, host: str = "127.0.0.1", port: int = 0, allowed_hosts: tuple[str, ...] = ("localhost",)
    ) -> None:
        if run_dir.is_file():  # a metrics file given directly
            self.metrics_path, self.run_dir = run_dir, run_dir.parent
        else:
            self.metrics_path, self.run_dir = run_dir / "metrics.jsonl", run_dir
        self.page = resources.files("relayrl.dashboard").joinpath("page.html").read_bytes()
        server_cls = _Server6 if ":" in host else _Server
        self.httpd = server_cls((host, port), _Handler)
        self.httpd.dashboard = self
        self.host = host
        self.allowed_hosts = allowed_hosts  # Host header names answered besides IPs and the bind host (DNS rebinding)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/"

    def snapshot(self, offset: int, file_id: str) -> dict[str, Any]:
        """The body of ``/api/metrics``."""
        chunk = read_metrics_chunk(self.metrics_path, offset, file_id)
        summary_path = self.run_dir / "summary.json"
        summary = _read_json(summary_path)
        try:  # the launcher writes summary.json once the services stopped; a resumed run appends metrics after it
            finished = summary is not None and (
                not self.metrics_path.exists() or summary_path.stat().st_mtime >= self.metrics_path.stat().st_mtime
            )
        except OSError:
            finished = False
        return {
            "run": self.run_dir.resolve().name,
            "metrics_path": str(self.metrics_path),
            "rows": chunk.rows,
            "offset": chunk.offset,
            "file": chunk.file_id,
            "reset": chunk.reset,
            "bad_lines": chunk.bad_lines,
            "finished": finished,
            "summary": summary if finished else None,
            "books": format_books(summary) if finished and summary is not None else None,
            "max_staleness": _max_staleness(self.run_dir / "config.yaml"),
        }

    def serve_forever(self) -> None:
        log.info("dashboard of %s on %s", self.metrics_path, self.url)
        self.httpd.serve_forever(poll_interval=0.25)

    def start(self) -> None:
        """Serve from a background thread (tests, embedding)."""
        self._thread = threading.Thread(target=self.serve_forever, name="dashboard", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(5)
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> DashboardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    dashboard: DashboardServer


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "relayrl-dashboard"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        dashboard = self.server.dashboard
        if not host_allowed(self.headers.get("Host"), dashboard.allowed_hosts, dashboard.host):
            self._send_json(
                HTTPStatus.BAD_REQUEST,
                {
                    "error": "invalid Host header: this dashboard does not answer "
                    "that name (relayrl dashboard --allow-host)"
                },
            )
            return
        try:
            if url.path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, "text/html; charset=utf-8", self.server.dashboard.page)
            elif url.path == "/api/metrics":
                query = parse_qs(url.query)
                offset = query.get("offset", ["0"])[0]
                if not offset.isdigit():
                    self._send_json(HTTPStatus.BAD_REQUEST, {"error": "offset must be a non-negative integer"})
                    return
                self._send_json(HTTPStatus.OK, self.server.dashboard.snapshot(int(offset), query.get("file", [""])[0]))
            elif url.path == "/healthz":
                self._send(HTTPStatus.OK, "text/plain; charset=utf-8", b"ok\n")
            else:
                self._send_json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {url.path}"})
        except (BrokenPipeError, ConnectionResetError):
            log.debug("client of %s went away", url.path)
        except Exception:
            log.exception("dashboard request %s failed", url.path)
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error; see the dashboard log"})

    def _send_json(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        self._send(status, "application/json", json.dumps(body, allow_nan=False).encode())

    def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def log_error(self, format: str, *args: Any) -> None:
        log.warning("%s %s", self.address_string(), format % args)
