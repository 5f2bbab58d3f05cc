"""`relayrl run`: the whole stack locally (embedded Redis, the four services) until it finishes or is stopped."""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

from relayrl.cli.args import add_overrides, resume_override

NAME = "run"
HELP = "run the whole stack locally (embedded Redis, four services)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="run config YAML")
    add_overrides(p)
    p.add_argument("--out", type=Path, default=None, help="output folder (default: output_dir, else runs/NAME-TIME)")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for service health")
    p.add_argument(
        "--resume",
        choices=("never", "auto"),
        default=None,
        help="auto: the trainer restores the newest checkpoint in the run folder, rollout continues",
    )


def run(args: argparse.Namespace) -> int:
    from relayrl.common.logging import records_held, setup_logging
    from relayrl.config import load_run_config
    from relayrl.config.sources import load_yaml
    from relayrl.launcher import Launcher

    with records_held():  # config warnings are written once the config chose the log format
        cfg = load_run_config(args.config, resume_override(args))
    setup_logging("launcher", 0, cfg.log_level, fmt=cfg.log_format)
    out = args.out
    if out is None:
        explicit = any(o.startswith("output_dir=") for o in args.overrides)
        out = (
            cfg.output_dir
            if explicit or "output_dir" in set(load_yaml(args.config))
            else Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
        )
    return Launcher(
        cfg, out, startup_timeout_s=args.startup_timeout, fresh=cfg.trainer.checkpoint.resume != "auto"
    ).run()
