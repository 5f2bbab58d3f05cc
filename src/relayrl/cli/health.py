"""`relayrl health`: one grpc.health.v1 Check of a service (the compose healthchecks run it)."""

from __future__ import annotations

import argparse

from relayrl.cli.args import add_tls_arguments, tls

NAME = "health"
HELP = "one grpc.health.v1 Check of a service; exit 0 when SERVING, else 1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, metavar="HOST:PORT", help="gRPC address of the service")
    p.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help="health service name, e.g. relayrl.v1.InferenceService (default: the server)",
    )
    p.add_argument("--timeout", type=float, default=3.0, metavar="S", help="deadline of the call in seconds")
    add_tls_arguments(p)


def run(args: argparse.Namespace) -> int:
    from relayrl.common.grpc_utils import health_status

    serving, status = health_status(args.target, args.timeout, args.service, tls(args))
    name = f" {args.service}" if args.service else ""
    print(f"{args.target}{name}: {status}")
    return 0 if serving else 1
