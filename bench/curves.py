"""Learning curves of bench/vs_trl.py: each system's step rows on its training clock, the time and step at which the
trailing mean reward first reaches a threshold, one run's summary, the mean over seeds, and the printed table with
the ratios relayrl / TRL."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

WINDOW = 10  # steps in the trailing mean the thresholds are checked on
FRACTIONS = (0.8, 0.9)  # thresholds, as fractions of the task's maximum reward


@dataclass(frozen=True)
class StepRow:
    step: int
    time_s: float  # on the system's training clock (module docstring)
    reward: float  # mean over the step's episodes
    tokens: float  # generated tokens of the step's episodes


@dataclass
class Result:
    system: str
    steps: int = 0
    train_s: float = 0.0
    wall_s: float = 0.0
    steps_per_s: float = 0.0
    tokens_per_s: float = 0.0
    final_reward: float = 0.0
    thresholds: dict[str, dict[str, float | int | None]] = field(default_factory=dict)


def time_to_threshold(rows: list[StepRow], threshold: float, window: int = WINDOW) -> tuple[int, float] | None:
    """(step, time) of the first row where the mean reward of the last ``window`` rows is >= threshold."""
    for i in range(window, len(rows) + 1):
        if statistics.fmean(r.reward for r in rows[i - window : i]) >= threshold:
            return rows[i - 1].step, rows[i - 1].time_s
    return None


def summarise(system: str, rows: list[StepRow], wall_s: float, max_reward: float) -> Result:
    if not rows:
        raise RuntimeError(f"{system} wrote no training steps")
    train_s = rows[-1].time_s
    res = Result(
        system,
        steps=rows[-1].step,
        train_s=train_s,
        wall_s=wall_s,
        steps_per_s=len(rows) / train_s,
        tokens_per_s=sum(r.tokens for r in rows) / train_s,
        final_reward=statistics.fmean(r.reward for r in rows[-WINDOW:]),
    )
    for frac in FRACTIONS:
        hit = time_to_threshold(rows, frac * max_reward)
        res.thresholds[f"{frac:g}"] = {"step": hit[0] if hit else None, "time_s": hit[1] if hit else None}
    return res


def mean_result(system: str, runs: list[Result]) -> Result:
    """The mean of each figure over runs (several seeds); a threshold's mean only where every run reached it."""
    res = Result(f"{system} mean", steps=runs[0].steps)
    for name in ("train_s", "wall_s", "steps_per_s", "tokens_per_s", "final_reward"):
        setattr(res, name, statistics.fmean(getattr(r, name) for r in runs))
    for frac in FRACTIONS:
        hits = [r.thresholds[f"{frac:g}"] for r in runs]
        reached = all(h["time_s"] is not None for h in hits)
        res.thresholds[f"{frac:g}"] = {
            k: statistics.fmean(float(h[k] or 0) for h in hits) if reached else None for k in ("step", "time_s")
        }
    return res


def _fmt(x: float | int | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(results: list[Result], max_reward: float) -> str:
    heads = ["system", "steps", "train s", "wall s", "steps/s", "gen tok/s", "final reward"]
    for frac in FRACTIONS:
        heads += [f"s to {frac * max_reward:g}", f"step to {frac * max_reward:g}"]
    lines = ["  ".join(f"{h:>13}" for h in heads)]
    for r in results:
        cells = [
            r.system,
            str(r.steps),
            f"{r.train_s:.1f}",
            f"{r.wall_s:.1f}",
            f"{r.steps_per_s:.2f}",
            f"{r.tokens_per_s:.0f}",
            f"{r.final_reward:.3f}",
        ]
        for frac in FRACTIONS:
            hit = r.thresholds[f"{frac:g}"]
            cells += [_fmt(hit["time_s"], ".1f"), _fmt(hit["step"], "g")]  # a step, or a mean over seeds
        lines.append("  ".join(f"{c:>13}" for c in cells))
    if len(results) == 2:
        trl, ours = results
        ratio = ["ratio relayrl/TRL: "]
        for frac in FRACTIONS:
            a, b = ours.thresholds[f"{frac:g}"]["time_s"], trl.thresholds[f"{frac:g}"]["time_s"]
            ratio.append(f"time to {frac:g}x max {_fmt(a / b if a and b else None, '.2f')}")
        ratio += [
            f"steps/s {ours.steps_per_s / trl.steps_per_s:.2f}",
            f"gen tok/s {ours.tokens_per_s / trl.tokens_per_s:.2f}",
            f"final reward {ours.final_reward / max(trl.final_reward, 1e-9):.2f}",
            f"wall {ours.wall_s / trl.wall_s:.2f}",
        ]
        lines.append(ratio[0] + ", ".join(ratio[1:]))
    return "\n".join(lines)
