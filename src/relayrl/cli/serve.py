"""`relayrl serve SERVICE CONFIG`: one service alone (what `relayrl run`, compose and the chart start)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
from pathlib import Path

from relayrl.cli.args import SERVICES, add_overrides, resume_override

NAME = "serve"
HELP = "run one service alone"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("service", choices=SERVICES)
    p.add_argument("config", type=Path, help="run config YAML")
    add_overrides(p)
    p.add_argument(
        "--resume",
        choices=("never", "auto"),
        default=None,
        help="trainer: auto restores the newest complete checkpoint (same as trainer.checkpoint.resume)",
    )


def run(args: argparse.Namespace) -> int:
    from relayrl.common.lifecycle import freeze_heap_at_start
    from relayrl.common.logging import records_held, setup_logging
    from relayrl.common.threads import apply_threads
    from relayrl.config import load_run_config
    from relayrl.config.sources import check_config_digest

    check_config_digest(args.config)
    with records_held():  # config warnings are written once the config chose the log format
        cfg = load_run_config(args.config, resume_override(args))
    setup_logging(args.service, int(os.environ.get("RANK", "0")), cfg.log_level, fmt=cfg.log_format)
    module = importlib.import_module(f"relayrl.{args.service}.main")
    apply_threads(getattr(cfg, args.service).threads, args.service)  # imported torch (if any), before its work
    freeze_heap_at_start()  # this process is the service: what its start-up builds lives as long as it does
    asyncio.run(module.serve(cfg))
    return 0
