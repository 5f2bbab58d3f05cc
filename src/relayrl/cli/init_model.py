"""`relayrl init-model`: the tiny demo model and its tokenizer, random init (what `make demo` trains)."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "init-model"
HELP = "create the tiny demo model and tokenizer (random init)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("models/tiny"), help="model directory to write")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a TinyModelConfig field, e.g. num_layers=4",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing model")


def run(args: argparse.Namespace) -> int:
    from relayrl.common.logging import setup_logging
    from relayrl.config.sources import apply_override
    from relayrl.config.typed import from_dict
    from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model

    setup_logging("init-model")
    data: dict[str, object] = {}
    for o in args.overrides:
        apply_override(data, o)
    cfg = from_dict(TinyModelConfig, data)
    if (args.out / "config.json").exists() and not args.force:
        print(f"{args.out} already holds a model; use --force to overwrite")
        return 0
    create_tiny_model(args.out, cfg)
    print(f"created {args.out}")
    return 0
