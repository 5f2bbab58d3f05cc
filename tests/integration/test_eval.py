"""`relayrl eval`: greedy accuracy, mean reward and pass@k of a model on a held-out dataset, through inference and
reward services it serves itself, written as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from relayrl.cli import main
from relayrl.evaluation import pass_at_k
from tests.chat_model import create_chat_model

pytestmark = pytest.mark.integration


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # at most one wrong sample: any 2 hold a correct one
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)


def test_eval_of_a_model_dir_scores_greedy_and_sampled_answers_through_the_services(tmp_path: Path) -> None:
    model = create_chat_model(tmp_path / "model", ends_turn=True)  # answers every prompt with an empty turn
    data = tmp_path / "heldout.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"q{i} 東京"}], "answer": "nothing" if i < 3 else "42"}
        for i in range(4)
    ]
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    cfg = tmp_path / "run.yaml"
    reward = {"function": "tests.reward_fns:says_nothing", "workers": 1}
    cfg.write_text(
        yaml.safe_dump(
            {"model": {"path": str(model)}, "reward": reward, "rollout": {"dataset": str(data), "max_new_tokens": 4}}
        )
    )

    rc = main(
        ["eval", str(cfg), "--dataset", str(data), "--k", "2", "--samples", "3", "--out", str(tmp_path / "eval.json")]
    )

    assert rc == 0
    out = json.loads((tmp_path / "eval.json").read_text())
    assert out["rows"] == 4 and out["reward_errors"] == 0
    assert out["greedy_accuracy"] == 0.75 and out["mean_reward"] == 0.75
    assert out["pass@2"] == 0.75 and out["sampled_mean_reward"] == 0.75 and out["samples_per_prompt"] == 3
    assert [r["greedy_correct"] for r in out["per_row"]] == [True, True, True, False]
    assert out["weight_version"] == 0  # the model as loaded from disk


def test_eval_with_only_one_service_address_is_a_config_error(tmp_path: Path, chat_model_dir: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(chat_model_dir)}, "rollout": {"dataset": str(data)}}))

    assert main(["eval", str(cfg), "--dataset", str(data), "--inference", "127.0.0.1:1"]) == 2


def test_eval_of_a_tool_workflow_plays_whole_episodes_and_reports_multi_turn_figures(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"1{i}+2{i}=", "answer": str(33 + 2 * i)}) + "\n" for i in range(3)))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tiny_model_dir)},
                "reward": {"function": "relayrl.tasks.calculator:reward", "workers": 1},
                "rollout": {
                    "dataset": str(data),
                    "workflow": "tools",
                    "tools": ["relayrl.tasks.calculator:c"],
                    "tool_format": "tagged",
                    "max_new_tokens": 6,
                    "max_turns": 2,
                    "max_episode_tokens": 40,
                },
            }
        )
    )

    rc = main(["eval", str(cfg), "--dataset", str(data), "--samples", "2", "--out", str(tmp_path / "eval.json")])

    assert rc == 0
    out = json.loads((tmp_path / "eval.json").read_text())
    assert out["rows"] == 3 and out["reward_errors"] == 0
    assert sum(out["episode_ends"].values()) == 3 * (1 + 2)  # one greedy and two sampled episodes per row
    assert set(out["episode_ends"]) <= {"done", "max_turns", "max_tokens", "max_tool_calls"}
    assert 1.0 <= out["turns_mean"] <= 2.0 and out["tool_calls_mean"] >= 0 and out["tool_errors"] >= 0
    assert all(len(r["turns"]) == 3 for r in out["per_row"])
