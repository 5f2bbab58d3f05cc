"""`relayrl runs`: the runs a Redis holds (each run's keys carry its name: relayrl.common.redis_keys), and deleting
an old one's state."""

from __future__ import annotations

import argparse
import sys

from relayrl.cli.args import EXIT_CONFIG, run_target

NAME = "runs"
HELP = "list the runs a Redis holds, or delete an old run's state"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("list", "delete"))
    p.add_argument("target", help="run folder or run config file (gives the Redis URL and key names)")
    p.add_argument("name", nargs="?", default="", help="delete: the run whose state goes")
    p.add_argument(
        "--yes",
        action="store_true",
        help="delete: really delete (the run's stream, books, dataset cursor, version history and dead letters)",
    )


def run(args: argparse.Namespace) -> int:
    from relayrl.common.redis_conn import sync_client
    from relayrl.common.redis_keys import RedisKeys, run_names
    from relayrl.status import redis_password

    target = run_target(args.target)
    if target is None:
        return EXIT_CONFIG
    cfg = target.cfg
    client = sync_client(cfg.redis, socket_timeout=10.0, **redis_password(cfg, target.run_dir))
    if args.action == "list":
        for name in run_names(client, cfg.redis):
            keys = RedisKeys.from_config(cfg.redis, name)
            entries = int(client.xlen(keys.stream)) if client.exists(keys.stream) else None
            version = int(client.get(keys.version_counter) or 0)
            held = f"{entries} stream entries" if entries is not None else "state deleted"
            print(f"{name}\t{held}, last version {version}{'  (this config)' if name == cfg.name else ''}")
        return 0
    if not args.name:
        print("relayrl: runs delete needs the run's name", file=sys.stderr)
        return EXIT_CONFIG
    keys = RedisKeys.from_config(cfg.redis, args.name)
    present = [key for key in keys.state() if client.exists(key)]
    if not args.yes:
        print(f"relayrl: would delete {len(present)} keys of run {args.name}: {', '.join(present)}; add --yes")
        return EXIT_CONFIG
    deleted = int(client.delete(*present)) if present else 0
    print(f"relayrl: deleted {deleted} keys of run {args.name}; its version counter {keys.version_counter} stays")
    return 0
