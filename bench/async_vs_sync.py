"""Asynchronous (max_staleness=2) vs synchronous (max_staleness=0) RL on the quickstart, in one invocation.

Runs `relayrl run examples/quickstart.yaml` twice for the same number of steps, the baseline
(max_staleness=0, fully on-policy) first, and prints episodes/s of each, their ratio, and the reward reached
(mean of the last 10 steps). Usage:

    python bench/async_vs_sync.py [--steps 400] [--model models/tiny] [--out runs/bench] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from relayrl.common.metrics_row import read_rows, rl_rows


def run(max_staleness: int, args: argparse.Namespace) -> dict[str, float]:
    out = args.out / f"staleness{max_staleness}"
    cmd = [
        sys.executable,
        "-m",
        "relayrl.cli",
        "run",
        args.config,
        "--out",
        str(out),
        "--set",
        f"rollout.max_staleness={max_staleness}",
        "--set",
        f"trainer.total_steps={args.steps}",
        "--set",
        f"model.path={args.model}",
        *[x for o in args.overrides for x in ("--set", o)],
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = rl_rows(read_rows(out / "metrics.jsonl"))
    # throughput over the steady part: from the end of step 1 (start-up excluded) to the last step
    episodes = sum(r.episodes for r in rows[1:])
    seconds = rows[-1].time_s - rows[0].time_s
    return {
        "episodes_per_s": episodes / seconds,
        "seconds": seconds,
        "reward_last10": statistics.mean(r.reward_mean for r in rows[-10:]),
        "staleness_mean": statistics.mean(r.staleness_mean for r in rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--config", default="examples/quickstart.yaml")
    parser.add_argument("--model", type=Path, default=Path("models/tiny"))
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    sync = run(0, args)
    asyn = run(2, args)
    print(f"{'mode':<22}{'episodes/s':>12}{'seconds':>10}{'reward (last 10)':>18}{'staleness':>11}")
    for name, r in (("sync  max_staleness=0", sync), ("async max_staleness=2", asyn)):
        print(
            f"{name:<22}{r['episodes_per_s']:>12.1f}{r['seconds']:>10.1f}{r['reward_last10']:>18.3f}"
            f"{r['staleness_mean']:>11.2f}"
        )
    print(
        f"async / sync throughput ratio: {asyn['episodes_per_s'] / sync['episodes_per_s']:.2f} "
        f"(reward {asyn['reward_last10']:.3f} vs {sync['reward_last10']:.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
