"""The SmolLM2 example's dataset: conversations whose held-out split never appears in training."""

from __future__ import annotations

from pathlib import Path

from relayrl.common.dataset import open_prompts
from relayrl.config.dataset import DatasetSpec
from relayrl.tasks.chat_addition import make_chat_dataset


def test_held_out_questions_are_disjoint_from_training_and_answers_are_the_sums(tmp_path: Path) -> None:
    train, held = make_chat_dataset(tmp_path / "train.jsonl", tmp_path / "held.jsonl", heldout_rows=50)

    train_rows, held_rows = (
        open_prompts(DatasetSpec(tmp_path / "train.jsonl")).train,
        open_prompts(DatasetSpec(tmp_path / "held.jsonl")).train,
    )
    assert (train, held) == (len(train_rows), len(held_rows)) == (90 * 90 - 50, 50)
    assert not {r.prompt_id for r in train_rows} & {r.prompt_id for r in held_rows}
    for r in held_rows:
        a, b = map(int, r.prompt_id.split("+"))
        assert r.answer == str(a + b) and r.prompt == f"What is {a} + {b}?" and r.messages[0][0] == "system"
