"""`relayrl plot`: metrics.jsonl drawn as a PNG (reward and staleness against step; relayrl.plot)."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "plot"
HELP = "draw metrics.jsonl (reward and staleness against step) as a PNG"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("metrics", type=Path, help="metrics.jsonl or a run folder")
    p.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: next to metrics)")


def run(args: argparse.Namespace) -> int:
    from relayrl.plot import plot_metrics

    path = args.metrics / "metrics.jsonl" if args.metrics.is_dir() else args.metrics
    out = args.output or path.with_name("metrics.png")
    plot_metrics(path, out)
    print(f"wrote {out}")
    return 0
