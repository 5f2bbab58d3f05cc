"""Draw metrics.jsonl: reward and staleness against step."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict[str, float]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row.get("phase", "rl") != "sft":
                rows.append(row)
    return rows


def plot_metrics(path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"{path} holds no training steps")
    steps = [r["step"] for r in rows]
    fig, (ax_r, ax_s) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[2, 1])
    ax_r.plot(steps, [r["reward_mean"] for r in rows], label="reward (mean)", color="tab:blue")
    if "reward/exact" in rows[0]:
        ax_r.plot(steps, [r["reward/exact"] for r in rows], label="exact answers", color="tab:green", alpha=0.7)
    ax_r.set_ylabel("reward")
    ax_r.set_ylim(-0.02, 1.02)
    ax_r.grid(alpha=0.3)
    ax_r.legend(loc="lower right")
    ax_r.set_title(f"{path.parent.name}: {len(rows)} steps, {rows[-1]['time_s']:.0f} s")
    ax_s.plot(steps, [r["staleness_mean"] for r in rows], label="mean", color="tab:orange")
    ax_s.plot(steps, [r["staleness_max"] for r in rows], label="max", color="tab:red", linestyle="--")
    ax_s.set_ylabel("staleness (versions)")
    ax_s.set_xlabel("trainer step")
    ax_s.grid(alpha=0.3)
    ax_s.legend(loc="upper right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
