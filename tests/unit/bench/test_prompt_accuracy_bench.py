"""bench/prompt_accuracy.py (where a run's missing reward sits, by prompt) on synthetic logs of both systems, and
bench/trl_grpo.py's optional per-call score log. TRL itself is not needed."""

from __future__ import annotations

import io
import json
from pathlib import Path

from tests.conftest import load_bench


def test_trl_scores_and_relayrl_dump_give_the_same_summary_for_the_same_samples(tmp_path: Path) -> None:
    acc = load_bench("prompt_accuracy")
    # two steps of two groups of 4: "0+0=" stuck wrong at step 2, "1+1=" right 3 times of 4 each step
    steps = [
        [("0+0=", [1.0, 0.0, 0.0, 0.0]), ("1+1=", [1.0, 1.0, 1.0, 0.0])],
        [("0+0=", [0.0, 0.0, 0.0, 0.0]), ("1+1=", [0.0, 1.0, 1.0, 1.0])],
    ]
    trl = tmp_path / "scores.jsonl"
    trl.write_text(
        "".join(
            json.dumps(
                {
                    "prompts": [p for p, s in step for _ in s],
                    "completions": ["x"] * 8,
                    "scores": [v for _, s in step for v in s],
                }
            )
            + "\n"
            for step in steps
        )
    )
    dump = tmp_path / "rank0.jsonl"
    dump.write_text(
        "".join(
            json.dumps({"step": i + 1, "group_id": f"g{i}-{p}", "prompt_text": p, "reward": v}) + "\n"
            for i, step in enumerate(steps)
            for p, s in step
            for v in s
        )
    )

    from_trl = acc.summarise(acc.trl_groups(trl, 4), last=2)
    from_relayrl = acc.summarise(acc.relayrl_groups(dump), last=2)

    assert from_trl == from_relayrl
    assert from_trl["groups"] == 4 and from_trl["groups_alike"] == 1 and from_trl["groups_stuck"] == 1
    assert from_trl["reward_mean"] == 7 / 16
    assert from_trl["prompts_below_0.9"] == [(0.125, "0+0=", 8), (0.75, "1+1=", 8)]
    assert acc.summarise(acc.trl_groups(trl, 4), last=1)["steps"] == 1  # only the last step


def test_trl_reward_wrapper_logs_each_call_only_when_asked() -> None:
    trl = load_bench("trl_grpo")
    log = io.StringIO()
    args = (["3+4=", "3+4="], ["7", "8"], ["7", "7"])

    quiet = trl.load_reward("relayrl.tasks.arithmetic:reward")(*args)
    logged = trl.load_reward("relayrl.tasks.arithmetic:reward", log)(*args)

    assert quiet == logged and logged[0] > logged[1]
    assert json.loads(log.getvalue()) == {"prompts": args[0], "completions": args[1], "scores": logged}
