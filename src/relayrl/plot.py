"""Draw metrics.jsonl: reward and staleness against step."""

from __future__ import annotations

import math
from pathlib import Path

from relayrl.common.metrics_row import RlRow, read_rows, rl_rows


def read_metrics(path: Path) -> list[RlRow]:
    """The training steps of a metrics.jsonl file (warm-up rows left out)."""
    return rl_rows(read_rows(path))


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _max_staleness(config_path: Path) -> int | None:
    if not config_path.is_file():
        return None
    import yaml

    data = yaml.safe_load(config_path.read_text()) or {}
    value = data.get("rollout", {}).get("max_staleness")
    return int(value) if value is not None else None


def plot_metrics(path: Path, out: Path, window: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"{path} holds no training steps")
    steps = [r.step for r in rows]
    fig, (ax_r, ax_s) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[2, 1])
    reward = [r.reward_mean for r in rows]
    ax_r.plot(steps, reward, color="tab:blue", alpha=0.25, linewidth=0.8)
    ax_r.plot(steps, rolling_mean(reward, window), label=f"reward (mean, {window}-step average)", color="tab:blue")
    if "exact" in rows[0].reward_components:
        exact = rolling_mean([r.reward_components.get("exact", math.nan) for r in rows], window)
        ax_r.plot(steps, exact, label="exact answers (fraction)", color="tab:green", linestyle=":")
    ax_r.set_ylabel("reward")
    ax_r.set_ylim(-0.02, 1.02)
    ax_r.grid(alpha=0.3)
    ax_r.legend(loc="lower right")
    ax_r.set_title(f"{path.parent.name}: {len(rows)} steps, {rows[-1].time_s:.0f} s")
    ax_s.plot(
        steps,
        rolling_mean([r.staleness_mean for r in rows], window),
        label=f"mean ({window}-step average)",
        color="tab:orange",
    )
    maxes = [float(r.staleness_max) for r in rows]
    ax_s.plot(
        steps,
        [max(maxes[max(0, i - window + 1) : i + 1]) for i in range(len(maxes))],
        label=f"max ({window}-step window)",
        color="tab:red",
    )
    bound = _max_staleness(path.parent / "config.yaml")
    if bound is not None:
        ax_s.axhline(bound, color="black", linestyle="--", linewidth=0.8, label=f"max_staleness = {bound}")
    ax_s.set_ylabel("staleness (versions)")
    ax_s.set_xlabel("trainer step")
    ax_s.grid(alpha=0.3)
    ax_s.set_ylim(-0.1, max([*maxes, bound or 0]) + 0.6)
    ax_s.legend(loc="upper right", ncols=3, fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
