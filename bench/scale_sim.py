"""Control-plane capacity by simulation: the real rollout service against 1 to 64 simulated inference replicas.

Two cores cannot show throughput scaling with real engines, so each replica is a latency model with no compute
(bench/scale_sim_replicas.py: continuous batching, a decode step of ``max_batch / tokens_per_s`` for up to
``max_batch`` sequences, ``prefill_steps`` steps of prefill per request, seeded early EOS), all N of them served by
one subprocess of their own. What is real: rollout itself (``relayrl serve rollout CONFIG``, its own process:
admission, routing over ``inference.endpoints`` by least samples in flight, GenerateBatch joining, ScoreBatch
joining, the group commit into Redis), the reward service (in this process, with its verifier worker processes,
the arithmetic reward), a redis-server, and the dataset (examples/data/arithmetic.jsonl).

The trainer is simulated in this process (scale_sim_replicas.SimTrainer): a TrainerService (GetStatus,
WatchStatus) whose consumer reads the stream as fast as groups arrive (XREADGROUP, XACK, XDEL) and reports step =
groups consumed // groups_per_step, serving from the start, weight version 0, never publishing. Admission follows it
for real; ``rollout.max_staleness`` is set high enough (``--max-staleness``) that the window never closes while the
consumer keeps up, and rollout's own wait counters (rollout_state.json: ``wait_ms_window``, ``wait_ms_concurrency``)
are printed to show it. ``rollout.max_concurrent_groups`` is ``--groups-per-replica`` x N, enough to fill every
replica's batch; ``rollout.generate_batch_max`` is ``--generate-batch-max`` (default 64, rollout's own; 0: one
Generate per group) and ``rollout.generate_calls_in_flight`` is ``--generate-calls-in-flight`` (default 1,
rollout's own): the joined calls on the wire per replica. Each caller gets its answer as soon as its samples end
(GenerateBatchStream, which the simulated replicas serve), but a group admitted meanwhile waits for a call to end.

Default latency parameters: ``--tokens-per-s 2791``, the native engine's measured throughput on this 2-core machine
(docs/benchmarks.md, bench/inference.py, run 1), at ``--max-batch 64`` (step 22.9 ms); ``--max-new-tokens 128`` with
``--eos-prob 0.5`` (mean length about 96, an engine capacity of about 29 episodes/s a replica), so that one replica is
the bottleneck at N = 1. A faster replica (``--tokens-per-s``, shorter ``--max-new-tokens``) finds where rollout
saturates.

For each N of ``--replicas``: warm up ``--warmup`` s, then count the groups appended to the stream (XINFO STREAM
entries-added) over ``--seconds`` and the CPU time (user + system, psutil) of rollout, the simulator, Redis and
this harness (simulated trainer, reward and its workers). Prints episodes/s, the ratio to N x the one-replica rate
(target >= 0.9 up to 16), each process's CPU %, the first N whose ratio falls below 0.9 (saturation), then, unless
``--no-profile``, rollout under cProfile at the largest N (its own run; cProfile slows it) with the top functions.
``--json PATH`` appends one JSON line with the figures. Usage:

    python bench/scale_sim.py --replicas 1,2,4,8,16,32,64 --seconds 10 [--json runs/scale_sim.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import pstats
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import psutil
import redis.asyncio as aioredis
import yaml

from relayrl.common.pb import trainer_pb2_grpc
from relayrl.config.reward import RewardConfig
from relayrl.local_redis import redis_server_args
from relayrl.reward.server import create_reward_server

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_sim_replicas import SimTrainer

REPO = Path(__file__).resolve().parent.parent
SIM = REPO / "bench" / "scale_sim_replicas.py"
TARGET = 0.9


@dataclass
class Point:
    replicas: int
    episodes_per_s: float
    ratio: float = 0.0
    cpu_pct: dict[str, float] = field(default_factory=dict)  # rollout, simulator, redis, harness
    sim_step_ratio: float = 1.0  # nominal / actual decode step of the simulator (< 1: it fell behind)
    rollout_waits_ms: dict[str, int] = field(default_factory=dict)
    rollout_state: dict[str, int] = field(default_factory=dict)  # rollout_state.json at its stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def start_sim(args: argparse.Namespace, n: int) -> tuple[subprocess.Popen[str], list[int]]:
    cmd = [sys.executable, str(SIM), f"--replicas={n}", f"--tokens-per-s={args.tokens_per_s}"]
    cmd += [f"--max-batch={args.max_batch}", f"--prefill-steps={args.prefill_steps}", f"--eos-prob={args.eos_prob}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the ports, once every replica listens ('' if it died)
    if not line:
        raise SystemExit(f"the simulator exited with {proc.wait()}")
    return proc, json.loads(line)["ports"]


def rollout_config(args: argparse.Namespace, work: Path, n: int, ports: list[int], targets: dict[str, str]) -> Path:
    """The rollout service's config for N replicas at ``ports``; the trainer, reward and Redis of ``targets``."""
    cfg = {
        "model": {"path": str(work / "no-model")},  # no config.json: nothing of a model is read
        "output_dir": str(work / f"out{n}"),
        "log_level": "WARNING",
        "redis": {"url": targets["redis"], "stream": targets["stream"]},
        "inference": {"endpoints": [{"address": f"127.0.0.1:{p}", "weights_address": "127.0.0.1:1"} for p in ports]},
        "reward": {"server": {"address": targets["reward"]}},
        "trainer": {"server": {"address": targets["trainer"]}},
        "rollout": {
            "dataset": str(REPO / "examples/data/arithmetic.jsonl"),
            "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens,
            "max_staleness": args.max_staleness,
            "max_concurrent_groups": args.groups_per_replica * n,
            "generate_batch_max": args.generate_batch_max,
            "generate_calls_in_flight": args.generate_calls_in_flight,
            "server": {"port": 0},
            "http": {"enabled": False},
            "drain_timeout_s": 0,  # stop at once after the window
        },
    }
    path = work / f"rollout{n}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_rollout(config: Path, profile: Path | None) -> subprocess.Popen[bytes]:
    prefix = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
    cmd = [sys.executable, *prefix, "-m", "relayrl.cli", "serve", "rollout", str(config)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=None)


async def wait_first_groups(trainer: SimTrainer, rollout: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while await trainer.appended() < 1:
        if rollout.poll() is not None:
            raise SystemExit(f"rollout exited with {rollout.returncode} before appending a group")
        if time.monotonic() > deadline:
            raise SystemExit(f"rollout appended nothing within {timeout_s:.0f} s")
        await asyncio.sleep(0.05)  # polling Redis for the first append


async def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
        await asyncio.sleep(0.05)


async def measure_point(
    args: argparse.Namespace, work: Path, n: int, env: dict[str, Any], profile: Path | None = None
) -> Point:
    """Rollout against N simulated replicas: episodes/s and each process's CPU % over the measured window."""
    sim, ports = start_sim(args, n)
    stream = f"scale_sim:n{n}:{'profile' if profile else 'run'}"
    trainer = SimTrainer(env["redis_url"], stream, "trainer", args.groups_per_step)
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(trainer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    consumer = asyncio.create_task(trainer.consume())
    targets = {"redis": env["redis_url"], "stream": stream, "reward": env["reward"], "trainer": f"127.0.0.1:{port}"}
    config = rollout_config(args, work, n, ports, targets)
    rollout = start_rollout(config, profile)
    try:
        await wait_first_groups(trainer, rollout)
        await asyncio.sleep(args.warmup)  # the measured window starts after the warm-up
        me = psutil.Process()
        procs = {"rollout": [psutil.Process(rollout.pid)], "simulator": [psutil.Process(sim.pid)]}
        procs["redis"] = [psutil.Process(env["redis_pid"])]
        others = (rollout.pid, sim.pid, env["redis_pid"])
        procs["harness"] = [me, *(c for c in me.children(recursive=True) if c.pid not in others)]
        c0, g0, t0 = {k: cpu_s(v) for k, v in procs.items()}, await trainer.appended(), time.monotonic()
        await asyncio.sleep(args.seconds)  # the measured window
        c1, g1, t1 = {k: cpu_s(v) for k, v in procs.items()}, await trainer.appended(), time.monotonic()
    finally:
        await stop_process(rollout)
        await stop_process(sim)
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await server.stop(0)
        await trainer.redis.aclose()
    state_path = work / f"out{n}" / "rollout_state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    sim_report = json.loads((sim.stdout.read() if sim.stdout else "") or "{}")
    wall = t1 - t0
    return Point(
        replicas=n,
        episodes_per_s=round((g1 - g0) * args.group_size / wall, 1),
        cpu_pct={k: round(100 * (c1[k] - c0[k]) / wall, 1) for k in c0},
        sim_step_ratio=float(sim_report.get("step_ratio", 0.0)),
        rollout_waits_ms={k.removeprefix("wait_ms_"): int(v) for k, v in state.items() if k.startswith("wait_ms_")},
        rollout_state=state,
    )


def with_ratios(points: list[Point]) -> list[Point]:
    """Each point's episodes/s against N x the smallest N's rate per replica."""
    base = points[0]
    per_replica = base.episodes_per_s / base.replicas
    return [replace(p, ratio=round(p.episodes_per_s / (p.replicas * per_replica or 1), 3)) for p in points]


def saturation(points: list[Point]) -> int | None:
    """The first N whose ratio falls below the target (None: none does)."""
    return next((p.replicas for p in points if p.ratio < TARGET), None)


def table(points: list[Point]) -> str:
    head = "| N | episodes/s | ratio to N x 1-replica | rollout CPU % | simulator CPU % | redis CPU % | harness CPU % |"
    head += " sim step ratio | rollout waits (ms) |"
    lines = [head, "|" + "---|" * 9]
    for p in points:
        c = p.cpu_pct
        waits = ", ".join(f"{k} {v}" for k, v in sorted(p.rollout_waits_ms.items())) or "-"
        lines.append(
            f"| {p.replicas} | {p.episodes_per_s:.1f} | {p.ratio:.3f} | {c['rollout']:.1f} | {c['simulator']:.1f} | "
            f"{c['redis']:.1f} | {c['harness']:.1f} | {p.sim_step_ratio:.3f} | {waits} |"
        )
    return "\n".join(lines)


def profile_lines(path: Path, top: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


@contextlib.asynccontextmanager
async def services(work: Path) -> AsyncIterator[dict[str, Any]]:
    """A private redis-server and the reward service (arithmetic, one verifier worker), for every point."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    (work / "redis").mkdir()
    port = free_port()
    proc = subprocess.Popen(redis_server_args(binary, port, work / "redis"), stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = aioredis.from_url(url)
    for _ in range(300):
        with contextlib.suppress(aioredis.ConnectionError):
            await client.ping()
            break
        await asyncio.sleep(0.05)  # polling until redis-server answers
    await client.aclose()
    defaults = RewardConfig()
    cfg = replace(defaults, server=replace(defaults.server, port=0), function="relayrl.tasks.arithmetic:reward")
    cfg = replace(cfg, workers=1)
    handle, servicer = create_reward_server(cfg)
    await servicer.start()
    await handle.start()
    try:
        yield {"redis_url": url, "redis_pid": proc.pid, "reward": f"127.0.0.1:{handle.port}"}
    finally:
        await handle.stop(0)
        await servicer.close()
        proc.terminate()
        proc.wait(10)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    ns = sorted({int(x) for x in args.replicas.split(",")})
    with tempfile.TemporaryDirectory(prefix="scale_sim") as tmp:
        work = Path(tmp)
        async with services(work) as env:
            points = []
            for n in ns:
                points.append(await measure_point(args, work, n, env))
                print(f"N={n}: {points[-1].episodes_per_s:.1f} episodes/s", flush=True)
            points = with_ratios(points)
            prof: dict[str, Any] | None = None
            if args.profile:
                path = work / "rollout.prof"
                profiled = await measure_point(args, work, ns[-1], env, profile=path)
                text = profile_lines(path, args.profile_top) if path.exists() else "(no profile written)"
                prof = {"replicas": ns[-1], "episodes_per_s": profiled.episodes_per_s, "text": text}
    step_s = args.max_batch / args.tokens_per_s
    return {
        "latency_model": {
            "tokens_per_s": args.tokens_per_s,
            "max_batch": args.max_batch,
            "step_ms": round(1000 * step_s, 2),
            "prefill_steps": args.prefill_steps,
            "max_new_tokens": args.max_new_tokens,
            "eos_prob": args.eos_prob,
        },
        "group_size": args.group_size,
        "generate_batch_max": args.generate_batch_max,
        "generate_calls_in_flight": args.generate_calls_in_flight,
        "seconds": args.seconds,
        "cpus": os.cpu_count(),
        "points": [asdict(p) for p in points],
        "saturation_n": saturation(points),
        "profile": prof,
    }


def report(result: dict[str, Any]) -> str:
    points = [Point(**p) for p in result["points"]]
    sat = result["saturation_n"]
    lines = [f"latency model: {json.dumps(result['latency_model'])}"]
    lines.append(
        f"rollout.generate_batch_max: {result['generate_batch_max']}, generate_calls_in_flight: "
        f"{result.get('generate_calls_in_flight', 1)}, group_size: {result['group_size']}"
    )
    lines.append(table(points))
    lines.append(
        f"saturation: ratio below {TARGET} first at N = {sat}"
        if sat is not None
        else f"saturation: none up to N = {points[-1].replicas} (ratio >= {TARGET} throughout)"
    )
    prof = result["profile"]
    if prof is not None:
        lines.append(f"rollout profile at N = {prof['replicas']} ({prof['episodes_per_s']:.1f} episodes/s, cProfile)")
        lines.append(prof["text"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="1,2,4,8,16,32,64", help="comma-separated replica counts")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per N")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds after the first append before measuring")
    ap.add_argument("--tokens-per-s", type=float, default=2791.0, help="a replica's decode tokens/s, batch full")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--prefill-steps", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--eos-prob", type=float, default=0.5)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-replica", type=int, default=16, help="max_concurrent_groups per replica")
    ap.add_argument("--groups-per-step", type=int, default=16, help="the simulated trainer's groups_per_step")
    ap.add_argument("--max-staleness", type=int, default=1000)
    ap.add_argument("--generate-batch-max", type=int, default=64, help="rollout.generate_batch_max (0: no joining)")
    ap.add_argument(
        "--generate-calls-in-flight",
        type=int,
        default=1,
        help="rollout.generate_calls_in_flight (joined calls per replica)",
    )
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--profile-top", type=int, default=25)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    print(report(result), flush=True)
    if args.json is not None:
        with args.json.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
