"""Reward throughput: math verifications/s in the verifier pool vs serially in-process, sandboxed code runs/s,
the quickstart's arithmetic reward through the pool (the IPC cost per request), and the quickstart's traffic
(ScoreBatch of 16, 8 in flight) against a `relayrl serve reward` process: episodes/s and the server's CPU time.

Usage:
    python bench/reward.py [--workers N] [--math-items 240] [--code-items 60] [--repeat 3] [--json out.json]

Each figure is items / wall seconds for the same items, the best of ``--repeat`` runs (the machine is shared: the
best run is the one least disturbed); the pool is started (and warmed with one batch) before timing. The math
items are generated (no data set is downloaded): fractions, powers, roots and polynomials, half written
equivalently to the reference and half wrong, drawn from wide ranges so that sympy's caches rarely hit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relayrl.config.reward import SandboxBackend, SandboxConfig
from relayrl.reward.api import RewardInput
from relayrl.reward.pool import VerifierPool
from relayrl.reward.protocol import Status
from relayrl.reward.sandbox import Sandbox
from relayrl.reward.scorer import Scorer, ScorerSpec


def math_items(n: int, seed: int = 0) -> list[RewardInput]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        a, b, c = rng.randint(1, 9999), rng.randint(2, 9999), rng.randint(1, 5)  # wide: no repeats to cache
        kind = i % 4
        if kind == 0:
            ref, good, bad = f"\\frac{{{a}}}{{{b}}}", f"{a / b:.10f}".rstrip("0"), f"\\frac{{{a + 1}}}{{{b}}}"
        elif kind == 1:
            ref, good, bad = f"(x+{a})^2", f"x^2+{2 * a}x+{a * a}", f"x^2+{a * a}"
        elif kind == 2:
            ref, good, bad = f"{c}\\sqrt{{{b}}}", f"\\sqrt{{{c * c * b}}}", f"{c + 1}\\sqrt{{{b}}}"
        else:
            ref, good, bad = str(a**c), f"{a}^{{{c}}}", str(a**c + 1)
        answer = good if i % 2 == 0 else bad
        items.append(RewardInput(prompt="", completion=f"So the answer is $\\boxed{{{answer}}}$.", reference=ref))
    return items


def code_items(n: int) -> list[RewardInput]:
    program = "```python\ndef add(a, b):\n    return a + b\n```"
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
    return [RewardInput(prompt="", completion=program, reference="", metadata={"tests": tests})] * n


def arithmetic_items(n: int) -> list[RewardInput]:
    return [
        RewardInput(prompt=f"{i % 5}+{i % 4}=", completion=str(i % 9), reference=str(i % 5 + i % 4)) for i in range(n)
    ]


def serial(function: str, items: list[RewardInput], warm: list[RewardInput], sandbox: SandboxConfig) -> float:
    scorer = Scorer(ScorerSpec(function=function), sandbox=Sandbox(sandbox))
    for inp in warm:  # imports, first parse; other items than the timed ones (sympy caches results)
        scorer(inp)
    t0 = time.perf_counter()
    for inp in items:
        scorer(inp)
    return len(items) / (time.perf_counter() - t0)


async def pooled(
    function: str,
    items: list[RewardInput],
    warm: list[RewardInput],
    workers: int,
    batch: int,
    concurrency: int,
    sandbox: SandboxConfig,
) -> float:
    pool = VerifierPool(ScorerSpec(function=function), sandbox, workers, timeout_s=60.0, chunk_size=32)
    await pool.start()
    try:
        await pool.score_many(warm)  # every worker's imports and first parse
        batches = [items[i : i + batch] for i in range(0, len(items), batch)]
        sem = asyncio.Semaphore(concurrency)
        failed = 0

        async def one(b: list[RewardInput]) -> None:
            nonlocal failed
            async with sem:
                failed += sum(o.status is not Status.OK for o in await pool.score_many(b))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(b) for b in batches))
        rate = len(items) / (time.perf_counter() - t0)
        if failed:
            raise RuntimeError(f"{failed} verifications failed")
        return rate
    finally:
        await pool.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree_cpu_s(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


async def _service_traffic(port: int, pid: int, batches: int) -> tuple[float, float]:
    import grpc

    from relayrl.common.pb import reward_pb2 as pb
    from relayrl.common.pb import reward_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RewardServiceStub(channel)
        for _ in range(300):  # wait for the service
            try:
                await stub.GetStatus(pb.GetRewardStatusRequest(), timeout=1)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
        request = pb.ScoreBatchRequest(
            requests=[
                pb.ScoreRequest(episode_id=str(i), prompt="3+4=", completion=str(i % 10), reference="7")
                for i in range(16)
            ]
        )
        for _ in range(20):
            await stub.ScoreBatch(request, timeout=10)
        sem = asyncio.Semaphore(8)

        async def one() -> None:
            async with sem:
                resp = await stub.ScoreBatch(request, timeout=30)
                if any(r.status != pb.SCORE_STATUS_OK for r in resp.responses):
                    raise RuntimeError("a score failed")

        cpu0, t0 = _tree_cpu_s(pid), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(batches)))
        wall, cpu = time.perf_counter() - t0, _tree_cpu_s(pid) - cpu0
    episodes = batches * 16
    return episodes / wall, 1000 * cpu / episodes * 1000


def service(batches: int) -> tuple[float, float]:
    """(episodes/s, server CPU ms per 1000 episodes) of `relayrl serve reward` with the quickstart reward."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "reward.yaml"
        config.write_text(f"reward:\n  function: arithmetic\n  server: {{port: {port}}}\n  http: {{port: 0}}\n")
        server = subprocess.Popen(
            [sys.executable, "-m", "relayrl.cli", "serve", "reward", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            return asyncio.run(_service_traffic(port, server.pid, batches))
        finally:
            server.terminate()
            server.wait(30)


def row(name: str, rate: float, base: float | None = None) -> str:
    speedup = f"{rate / base:.2f}x" if base else ""
    return f"| {name} | {rate:,.0f} | {speedup} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--math-items", type=int, default=240)
    parser.add_argument("--code-items", type=int, default=60)
    parser.add_argument("--arith-items", type=int, default=20000)
    parser.add_argument("--service-batches", type=int, default=1500)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    bwrap, process = SandboxConfig(), SandboxConfig(backend=SandboxBackend.PROCESS)
    results: dict[str, Any] = {"workers": args.workers, "cpus": os.cpu_count()}
    w = args.workers
    math_warm, code_warm, arith_warm = math_items(16, seed=10_000), code_items(8), arithmetic_items(16)
    # each repetition scores other math items (seed = repetition): sympy's caches must not favour either side
    runs: list[tuple[str, str, Callable[[int], float], str | None]] = [
        (
            "math_serial",
            "math verifications/s, serial in-process",
            lambda r: serial("math", math_items(args.math_items, r), math_warm, bwrap),
            None,
        ),
        (
            "math_pool",
            f"math verifications/s, pool of {w} (batches of 16, 8 in flight)",
            lambda r: asyncio.run(pooled("math", math_items(args.math_items, r), math_warm, w, 16, 8, bwrap)),
            "math_serial",
        ),
        (
            "code_serial",
            "sandboxed code runs/s (bwrap), one at a time in-process",
            lambda r: serial("code", code_items(args.code_items), code_warm, bwrap),
            None,
        ),
        (
            "code_pool",
            f"sandboxed code runs/s (bwrap), pool of {w}",
            lambda r: asyncio.run(pooled("code", code_items(args.code_items), code_warm, w, 8, 4, bwrap)),
            "code_serial",
        ),
        (
            "code_pool_process",
            f"sandboxed code runs/s (process backend), pool of {w}",
            lambda r: asyncio.run(pooled("code", code_items(args.code_items), code_warm, w, 8, 4, process)),
            "code_serial",
        ),
        (
            "arith_serial",
            "quickstart arithmetic reward/s, serial in-process",
            lambda r: serial("arithmetic", arithmetic_items(args.arith_items), arith_warm, bwrap),
            None,
        ),
        (
            "arith_pool",
            f"quickstart arithmetic reward/s, pool of {w} (groups of 16, 8 in flight)",
            lambda r: asyncio.run(
                pooled("arithmetic", arithmetic_items(args.arith_items), arith_warm, w, 16, 8, bwrap)
            ),
            "arith_serial",
        ),
    ]
    lines = ["| measure | per second | vs serial |", "|---|---|---|"]
    for key, name, fn, base in runs:
        results[key] = max(fn(r) for r in range(args.repeat))
        lines.append(row(name, results[key], results[base] if base else None))
        print(lines[-1], flush=True)
    results["service_episodes_per_s"], results["service_cpu_ms_per_1000"] = max(
        service(args.service_batches) for _ in range(args.repeat)
    )
    lines.append(
        f"| quickstart traffic to `relayrl serve reward` (ScoreBatch of 16, 8 in flight), episodes/s | "
        f"{results['service_episodes_per_s']:,.0f} | server CPU {results['service_cpu_ms_per_1000']:.0f} ms "
        "per 1000 episodes |"
    )
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
