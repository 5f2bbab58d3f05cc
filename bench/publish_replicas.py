"""Weight publication to 1, 2 and 4 inference replicas, for each transport, on one model (issue 33's fan-out).

Each replica is its own process (a native-engine inference server on loopback, one torch thread, as
``bench/publish.py`` serves one); the trainer side is this process's ``WeightPublisher`` with every replica as a
target, exactly as the trainer publishes: the update prepared once, sent to every replica at once, each replica's
answer verified (its served-weights checksum; the probe on the first push only, ``probe_every 0``). For each transport
and replica count it pushes ``--pushes`` fresh versions after a warm-up push and prints the median publication time,
its ratio to one replica's, and the CPU seconds of the trainer side (this process: what fan-out costs the sender)
and of all replicas together (each checks what arrived: checksum, finite values; then swaps).

On a machine with fewer cores than replicas + 1 the replicas' own work queues for the cores: the wall-time ratio then
shows the machine, not the transport; the trainer's CPU column shows what each transport's fan-out costs the sender,
and the replicas' column divided by N what each replica needs of its own core. Usage:

    python bench/publish_replicas.py MODEL_DIR [--replicas 1 2 4] [--pushes 3]
        [--transports grpc_stream shared_memory shared_path collective] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))  # bench/publish.py's replica server

TRANSPORTS = ("grpc_stream", "shared_memory", "shared_path", "collective")


def serve_replica(model_dir: Path, weights_dir: Path) -> None:
    """One replica (the ``--serve`` mode of this script): prints its weights target, serves until stdin closes."""
    from publish import _serve

    from relayrl.config.model import ModelConfig

    torch.set_num_threads(1)

    async def run() -> None:
        service, main, weights = await _serve(model_dir, weights_dir, ModelConfig(path=model_dir), "native")
        print(f"READY {service.weights_target}", flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await main.stop(0)
        await weights.stop(0)

    asyncio.run(run())


def start_replicas(n: int, model_dir: Path, weights_dir: Path) -> list[tuple[subprocess.Popen[str], str]]:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(model_dir), "--serve", str(weights_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for _ in range(n)
    ]
    out = []
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        if not line or line[0] != "READY":
            raise RuntimeError(f"a replica did not start: {line}")
        out.append((proc, line[1]))
    return out


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


async def measure(
    model: Any, probe: list[list[int]], targets: list[str], transport: str, versions: Any, pushes: int, **where: Any
) -> dict[str, float]:
    """Median seconds and CPU seconds (all processes) of ``pushes`` publications to ``targets``."""
    from relayrl.config.control import ControlConfig
    from relayrl.config.publication import PublicationConfig, WeightTransport
    from relayrl.trainer.transports import collective_host, make_transport
    from relayrl.trainer.weight_sync import WeightPublisher

    kind = WeightTransport(transport)
    pub = WeightPublisher(
        model,
        torch.device("cpu"),
        targets,
        make_transport(kind, 2 * 1024 * 1024, where["weights_dir"], collective_host(PublicationConfig(transport=kind))),
        120.0,
        probe,
        None,
        token=ControlConfig().effective_weights_token(),
        probe_every=0,
    )
    rows = []
    for i in range(pushes + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn_like(p))
        c0, r0, t0 = _cpu_s(where["pids"][:1]), _cpu_s(where["pids"][1:]), time.perf_counter()
        result = await pub.push(pub.snapshot(), next(versions))
        elapsed = time.perf_counter() - t0
        trainer, replicas = _cpu_s(where["pids"][:1]) - c0, _cpu_s(where["pids"][1:]) - r0
        if not result.verified or pub.behind:
            raise RuntimeError(f"{transport} to {len(targets)}: unverified or behind {pub.behind}")
        if i:  # the first push warms up channels, groups and allocators
            rows.append({"seconds": elapsed, "trainer_cpu_s": trainer, "replicas_cpu_s": replicas})
    await pub.close()
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from relayrl.common.model import load_model, load_tokenizer
    from relayrl.config.model import ModelConfig
    from relayrl.trainer.weight_sync import WeightPublisher

    model = load_model(ModelConfig(path=args.model_dir))
    probe = WeightPublisher.default_probe(model, load_tokenizer(args.model_dir), 2, 8, seed=0)
    versions = itertools.count(1)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        weights_dir = Path(tmp) / "weights"
        replicas = start_replicas(max(args.replicas), args.model_dir, weights_dir)
        pids = [os.getpid(), *(p.pid for p, _ in replicas)]
        try:
            for transport in args.transports:
                one = 0.0
                for n in args.replicas:
                    targets = [t for _, t in replicas[:n]]
                    r = await measure(
                        model, probe, targets, transport, versions, args.pushes, weights_dir=weights_dir, pids=pids
                    )
                    one = one or r["seconds"]
                    rows.append({"transport": transport, "replicas": n, **r, "ratio": r["seconds"] / one})
                    print(
                        f"{transport:14s} {n} replica(s)  {r['seconds']:7.3f} s  ({r['seconds'] / one:4.2f}x one)"
                        f"  cpu: trainer {r['trainer_cpu_s']:6.2f} s, replicas {r['replicas_cpu_s']:6.2f} s"
                        f"  load {os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
        finally:
            for proc, _ in replicas:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=60)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # internal: run one replica, weights dir
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    ap.add_argument("--json", type=Path, help="append one JSON line with the figures")
    args = ap.parse_args()
    os.environ.setdefault("RELAYRL_WEIGHTS_TOKEN", secrets.token_urlsafe(32))  # both sides read it from here
    if args.serve is not None:
        serve_replica(args.model_dir, args.serve)
        return
    from safetensors import safe_open

    with safe_open(str(args.model_dir / "model.safetensors"), "pt") as f:
        n = sum(int(torch.Size(f.get_slice(k).get_shape()).numel()) for k in f.keys())  # noqa: SIM118
    print(f"model {args.model_dir} ({n / 1e6:.1f} M parameters), {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    rows = asyncio.run(run(args))
    if args.json is not None:
        with args.json.open("a") as f:
            f.write(json.dumps({"model": str(args.model_dir), "parameters": n, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
