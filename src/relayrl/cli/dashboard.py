"""`relayrl dashboard`: a live page of a run's metrics (the page and its server: relayrl.dashboard.server)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from relayrl.cli.args import port

NAME = "dashboard"
HELP = (
    "serve a live page of a run's metrics: reward, staleness, throughput and queue depth against step (Ctrl-C stops it)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="run folder (holding metrics.jsonl) or a metrics.jsonl file")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=0, help="TCP port (0: any free port; the URL is printed)")
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host header name to answer besides localhost, IP addresses and --host (repeatable; "
        "'*' answers any name, which lets a web page read the metrics by DNS rebinding)",
    )


def run(args: argparse.Namespace) -> int:
    """Serve the page until Ctrl-C; 1 when the address cannot be bound."""
    from relayrl.common.logging import setup_logging
    from relayrl.dashboard.server import DashboardServer

    setup_logging("dashboard")
    try:
        server = DashboardServer(args.run_dir, args.host, args.port, ("localhost", *args.allow_host))
    except OSError as exc:
        print(f"relayrl: cannot serve the dashboard on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    print(f"relayrl dashboard: {server.url} (run {args.run_dir}; Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        logging.getLogger("relayrl.dashboard").info("stopped")
    finally:
        server.close()
    return 0
