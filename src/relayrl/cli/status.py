"""`relayrl status`: the live state of a run or one service (relayrl.status)."""

from __future__ import annotations

import argparse
import asyncio
import json

from relayrl.cli.args import add_tls_arguments, tls

NAME = "status"
HELP = "live state: versions per service, queue lag, throughput, staleness, reward"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="run folder, run config file, or one service's HOST:PORT")
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S", help="deadline of each call")
    add_tls_arguments(p)


def run(args: argparse.Namespace) -> int:
    from relayrl.status import collect, exit_code, render, resolve

    state = asyncio.run(collect(resolve(args.target), args.timeout, tls(args)))
    print(json.dumps(state, indent=1) if args.json else render(state))
    return exit_code(state)
