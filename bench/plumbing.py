"""Process-CPU time per trainer step, summed over every process of a `relayrl run` (issue 14: the plumbing).

Starts ``relayrl run CONFIG`` and, from psutil over the launcher's process tree (the services, Redis, reward's
verifier pool), reads each process's user + system CPU time when metrics.jsonl first reaches step ``--from`` and
again at step ``--to``; prints the CPU milliseconds per trainer step of each service and of them all, the wall
time per step, and the trainer's time breakdown (means of the rows in the window). On a shared machine wall times
swing with the load; CPU per step is the figure to compare (alternate the two variants in the same minutes).
Usage:

    python bench/plumbing.py examples/quickstart.yaml --out runs/plumb --from 50 --to 150 [--set KEY=VALUE ...]

``--json PATH`` appends one JSON line with the figures. The run is stopped once step ``--to`` is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

SERVICES = ("inference", "rollout", "reward", "trainer")
PARTS = (
    "data",
    "data_generating",
    "data_transit",
    "fwd_bwd",
    "optimizer",
    "publish",
    "publish_wait",
    "checkpoint",
    "metrics",
    "other",
)


def service_of(proc: psutil.Process, launcher: int) -> str:
    """The service a process of the run belongs to (its own command line, else its ancestors')."""
    p: psutil.Process | None = proc
    while p is not None and p.pid != launcher:
        try:
            cmd = " ".join(p.cmdline())
            if "redis-server" in cmd:
                return "redis"
            for name in SERVICES:
                if f"serve {name}" in cmd:
                    return name
            p = p.parent()
        except psutil.Error:
            return "other"
    return "launcher"


def cpu_snapshot(launcher: psutil.Process) -> dict[int, tuple[str, float]]:
    """pid -> (service, user + system CPU seconds) over the launcher and every descendant."""
    out: dict[int, tuple[str, float]] = {}
    for proc in [launcher, *launcher.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            out[proc.pid] = (service_of(proc, launcher.pid), t.user + t.system)
        except psutil.Error:
            continue
    return out


def last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    lines = metrics.read_text().splitlines()
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "step" in row and "reward_mean" in row:
            return int(row["step"])
    return 0


def wait_for_step(proc: subprocess.Popen[bytes], metrics: Path, step: int) -> float:
    while last_step(metrics) < step:
        if proc.poll() is not None:
            raise SystemExit(f"the run ended before step {step} (exit {proc.returncode})")
        time.sleep(0.05)  # polling a file the run writes; not a synchronisation of the run itself
    return time.monotonic()


def breakdown(metrics: Path, lo: int, hi: int) -> dict[str, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward_mean" in r and lo < int(r["step"]) <= hi]
    mean = {p: 1000 * sum(r.get(f"time_{p}_s", 0.0) for r in rows) / max(len(rows), 1) for p in PARTS}
    mean["wall"] = 1000 * sum(r.get("time_wall_s", 0.0) for r in rows) / max(len(rows), 1)
    mean["reward_last10"] = sum(r["reward_mean"] for r in rows[-10:]) / max(len(rows[-10:]), 1)
    return mean


def measure(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    sets = [
        x
        for s in [f"trainer.total_steps={args.to + 20}", "trainer.checkpoint.every=0", *args.set]
        for x in ("--set", s)
    ]
    cmd = [sys.executable, "-m", "relayrl.cli", "run", args.config, "--out", str(out), *sets]
    out.mkdir(parents=True)
    with (out / "launcher.txt").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        launcher = psutil.Process(proc.pid)
        t_a = wait_for_step(proc, out / "metrics.jsonl", args.start)
        a, load_a = cpu_snapshot(launcher), os.getloadavg()[0]
        t_b = wait_for_step(proc, out / "metrics.jsonl", args.to)
        b, load_b = cpu_snapshot(launcher), os.getloadavg()[0]
        steps = last_step(out / "metrics.jsonl") - args.start  # the row may have moved on by a step
        steps = max(steps, 1)
    finally:
        if proc.poll() is None:  # a run that ended early (a bad config) has no group left to stop
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    per: dict[str, float] = {}
    for pid, (svc, cpu) in b.items():
        per[svc] = per.get(svc, 0.0) + cpu - (a[pid][1] if pid in a else 0.0)
    result: dict[str, Any] = {
        "config": args.config,
        "set": args.set,
        "steps": steps,
        "load": [round(load_a, 2), round(load_b, 2)],
        "wall_ms_per_step": round(1000 * (t_b - t_a) / steps, 1),
        "cpu_ms_per_step": {k: round(1000 * v / steps, 1) for k, v in sorted(per.items())},
        "cpu_ms_per_step_total": round(1000 * sum(per.values()) / steps, 1),
        "trainer_breakdown_ms": {
            k: round(v, 1) for k, v in breakdown(out / "metrics.jsonl", args.start, args.to).items()
        },
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--out", default="runs/plumbing")
    ap.add_argument("--from", dest="start", type=int, default=50)
    ap.add_argument("--to", type=int, default=150)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    result = measure(args)
    print(json.dumps(result, indent=1))
    if args.json is not None:
        with args.json.open("a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
