"""`relayrl debug collectives`: the ranks' recorded collectives compared, the first divergence named."""

from __future__ import annotations

import argparse

NAME = "debug"
HELP = "debugging tools"


def add_arguments(p: argparse.ArgumentParser) -> None:
    debug_sub = p.add_subparsers(dest="debug_command", required=True)
    coll = debug_sub.add_parser(
        "collectives",
        help="compare the ranks' recorded collectives; name the first "
        "divergence (record with "
        "trainer.distributed.record_collectives=true)",
    )
    coll.add_argument("run_dir", help="run folder (or its collectives/ folder)")


def run(args: argparse.Namespace) -> int:
    from relayrl.trainer.collective_debug import main as collectives_main

    return collectives_main([args.run_dir])
