"""`relayrl eval`: a model directory or checkpoint scored on a held-out dataset through the inference and reward
services (relayrl.evaluation)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from relayrl.cli.args import add_overrides

NAME = "eval"
HELP = (
    "score a model directory or checkpoint on a held-out dataset through the inference and reward services: "
    "greedy accuracy, mean reward, pass@k (JSON)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="run config YAML (model, rollout sampling settings, reward verifier)")
    p.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help="held-out rows, read like rollout.dataset (default: the rows rollout.held_out_rows holds out of it)",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model directory or checkpoint (default: model.path); a LoRA checkpoint is merged first",
    )
    p.add_argument("--k", type=int, default=0, help="pass@k with k sampled completions (0: greedy only)")
    p.add_argument("--samples", type=int, default=0, help="sampled completions per row (default: k; >= k)")
    p.add_argument("--threshold", type=float, default=1.0, help="a completion is correct at reward >= this")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N rows")
    p.add_argument("--concurrency", type=int, default=8, help="rows evaluated at once")
    p.add_argument("--out", type=Path, default=None, help="write the full result (every row) as JSON here")
    p.add_argument(
        "--inference",
        default="",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="use this running inference service (with --reward) instead of serving --model; several replicas, "
        "comma-separated, share the work",
    )
    p.add_argument("--reward", default="", metavar="HOST:PORT", help="the running reward service to use")
    add_overrides(p)


def run(args: argparse.Namespace) -> int:
    from relayrl.common.logging import records_held, setup_logging
    from relayrl.config import load_run_config
    from relayrl.config.typed import ConfigError
    from relayrl.evaluation import EvalSettings, run_eval

    with records_held():
        cfg = load_run_config(args.config, args.overrides)
    setup_logging("eval", 0, cfg.log_level, fmt=cfg.log_format)
    for name in ("k", "samples", "limit"):
        if getattr(args, name) < 0:
            raise ConfigError(name, getattr(args, name), "must be >= 0")
    if args.concurrency < 1:
        raise ConfigError("concurrency", args.concurrency, "must be >= 1")
    result = run_eval(
        cfg,
        EvalSettings(args.k, args.samples, args.threshold, args.concurrency, args.limit),
        args.dataset,
        args.model,
        args.inference,
        args.reward,
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_row"}, indent=1))
    return 0
