"""`relayrl control`: operate a running stack (pause/resume generation, checkpoint now) with the control token."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from relayrl.cli.args import EXIT_CONFIG, run_target

NAME = "control"
HELP = "operate a running stack: pause/resume generation, checkpoint now"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("pause", "resume", "checkpoint"))
    p.add_argument("target", help="run folder or run config file (gives the service addresses)")
    p.add_argument("--reason", default="", help="free text for the services' logs")
    p.add_argument(
        "--token-env",
        default="RELAYRL_CONTROL_TOKEN",
        metavar="VAR",
        help="environment variable with the bearer token (default: the run folder's control_token, "
        "which `relayrl run` writes)",
    )


def run(args: argparse.Namespace) -> int:
    import grpc

    from relayrl.client import RolloutClient, TrainerClient
    from relayrl.common.service import as_dict
    from relayrl.launcher import CONTROL_TOKEN_FILE

    target = run_target(args.target)
    if target is None:
        return EXIT_CONFIG
    cfg = target.cfg
    token = os.environ.get(args.token_env, "")
    token_file = target.run_dir / CONTROL_TOKEN_FILE if target.run_dir is not None else None
    if not token and token_file is not None and token_file.is_file():  # the run's own, written by `relayrl run`
        token = token_file.read_text().strip()

    async def act() -> object:
        if args.action == "checkpoint":
            async with TrainerClient(cfg.trainer.server.target, token=token, tls=cfg.tls) as trainer:
                return await trainer.request_checkpoint(args.reason)
        async with RolloutClient(cfg.rollout.server.target, token=token, tls=cfg.tls) as rollout:
            return await (rollout.pause(args.reason) if args.action == "pause" else rollout.resume())

    try:
        reply = asyncio.run(act())
    except grpc.aio.AioRpcError as exc:
        print(f"relayrl: {args.action} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(json.dumps(as_dict(reply), indent=1))  # type: ignore[arg-type]
    return 0
