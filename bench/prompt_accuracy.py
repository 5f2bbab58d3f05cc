"""Where a run's missing reward sits, by prompt: TRL's sample log and relayrl's episode dump, side by side.

    python bench/prompt_accuracy.py --trl runs/acc/trl/scores.jsonl \
        --relayrl runs/acc/relayrl/trained/episodes/rank0.jsonl [--last 100]

``--trl``: the ``scores`` file of bench/trl_grpo.py (one line per reward call: a step's prompts, completions and
scores). ``--relayrl``: the trainer's episode dump of a run with ``trainer.dump_episodes`` at least the step's
episodes (``rows`` of ``step`` and the episode's fields). For each, over the last ``--last`` steps: the mean
reward, the groups whose samples all scored alike (zero advantage under a group baseline: nothing learns from
them), how many of those scored below the maximum (a prompt stuck on a wrong answer), and the prompts whose mean
is below 0.9 of the maximum, worst first. A score's maximum is taken as the largest score seen.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

Groups = list[tuple[str, list[float]]]  # (prompt, its group's scores), in step order


def trl_groups(path: Path, group_size: int) -> list[Groups]:
    """Per step: the groups of one reward call (TRL repeats each prompt ``group_size`` times in a row)."""
    steps = []
    for line in path.read_text().splitlines():
        call = json.loads(line)
        prompts, scores = call["prompts"], call["scores"]
        steps.append([(_text(prompts[i]), scores[i : i + group_size]) for i in range(0, len(prompts), group_size)])
    return steps


def relayrl_groups(path: Path) -> list[Groups]:
    """Per step: its groups, from the episode dump (``group_id`` joins a group's samples)."""
    by_step: dict[int, dict[str, tuple[str, list[float]]]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        group = by_step[int(row["step"])].setdefault(row["group_id"], (row.get("prompt_text", ""), []))
        group[1].append(float(row.get("reward", 0.0)))
    return [list(by_step[s].values()) for s in sorted(by_step)]


def _text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def summarise(steps: list[Groups], last: int) -> dict[str, Any]:
    window = steps[-last:]
    top = max((s for groups in window for _, scores in groups for s in scores), default=1.0) or 1.0
    groups = [g for step in window for g in step]
    flat = [s for _, scores in groups for s in scores]
    alike = [scores for _, scores in groups if len(set(scores)) <= 1]
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for prompt, scores in groups:
        by_prompt[prompt] += scores
    means = {p: sum(v) / len(v) / top for p, v in by_prompt.items()}  # of the maximum
    weak = sorted((m, p, len(by_prompt[p])) for p, m in means.items() if m < 0.9)
    return {
        "steps": len(window),
        "groups": len(groups),
        "reward_mean": sum(flat) / max(len(flat), 1),
        "groups_alike": len(alike),
        "groups_stuck": sum(1 for s in alike if s and s[0] < top),
        "prompts": len(by_prompt),
        "prompts_below_0.9": [(round(m, 3), p, n) for m, p, n in weak],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trl", type=Path, help="bench/trl_grpo.py's scores file")
    ap.add_argument("--relayrl", type=Path, help="the trainer's episode dump (trained/episodes/rank0.jsonl)")
    ap.add_argument("--group-size", type=int, default=16, help="TRL's num_generations")
    ap.add_argument("--last", type=int, default=100, help="steps at the end of each run to look at")
    args = ap.parse_args()
    runs = {}
    if args.trl:
        runs["TRL"] = summarise(trl_groups(args.trl, args.group_size), args.last)
    if args.relayrl:
        runs["relayrl"] = summarise(relayrl_groups(args.relayrl), args.last)
    for name, r in runs.items():
        print(
            f"{name}: last {r['steps']} steps, {r['groups']} groups of {r['prompts']} prompts: reward mean "
            f"{r['reward_mean']:.3f}; groups scored alike {r['groups_alike']} ({r['groups_stuck']} below the "
            f"maximum); prompts below 0.9: {len(r['prompts_below_0.9'])}"
        )
        for mean, prompt, n in r["prompts_below_0.9"]:
            print(f"    {mean:.3f}  {prompt!r}  ({n} samples)")
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
