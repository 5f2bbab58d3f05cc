"""The `relayrl` command line: one module per command in this package, each with its ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int`` (heavy imports inside ``run``: `relayrl status` and `relayrl
control` load no torch). A new command is a module and a line in :data:`COMMANDS`, in the order `relayrl --help`
lists them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from relayrl.cli import (
    control,
    dashboard,
    debug,
    evaluate,
    health,
    import_model,
    init_model,
    make_dataset,
    merge_lora,
    plot,
    run,
    runs,
    serve,
    slurm,
    status,
)
from relayrl.cli.args import EXIT_CONFIG, SERVICES
from relayrl.config.typed import ConfigError

__all__ = ["COMMANDS", "EXIT_CONFIG", "SERVICES", "main", "parser"]

COMMANDS: tuple[ModuleType, ...] = (
    run,
    slurm,
    serve,
    init_model,
    import_model,
    merge_lora,
    evaluate,
    make_dataset,
    debug,
    health,
    status,
    control,
    runs,
    plot,
    dashboard,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relayrl", description="Asynchronous RL post-training over gRPC.")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_arguments(sub.add_parser(command.NAME, help=command.HELP))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    command = next(c for c in COMMANDS if args.command == c.NAME)
    try:
        return int(command.run(args))
    except ConfigError as exc:
        print(f"relayrl: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
