"""Datasets in the formats users bring (JSONL, Parquet, Arrow, a `datasets` save_to_disk folder, a folder of shards),
under their own field names, checked row by row with bad rows refused or skipped, split into training and held-out
rows, and read row by row rather than whole."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relayrl.common.dataset import PromptCursor, eval_prompts, open_prompts
from relayrl.config.dataset import BadRows, DatasetFields, DatasetFormat, DatasetSpec
from relayrl.config.rollout import RolloutConfig
from relayrl.config.typed import ConfigError

# verl's layout: the conversation under `prompt`, the answer nested under `reward_model`
FIELDS = DatasetFields(prompt="question", messages="prompt", answer="reward_model.ground_truth", id="uid")


def _rows(n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(n):
        row: dict[str, Any] = {"uid": f"r{i}", "reward_model": {"ground_truth": str(i * 2)}, "level": i % 3}
        if i % 2:
            row["prompt"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{i}+{i}="}]
        else:
            row["question"] = f"{i}+{i}="
        rows.append(row)
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    keys = list(dict.fromkeys(k for r in rows for k in r))  # a column is null where a row lacks it
    return pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])


def _write(fmt: str, folder: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` written as ``fmt``; returns what rollout.dataset names."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        return _write_jsonl(folder / "train.jsonl", rows)
    if fmt == "parquet":
        pq.write_table(_table(rows), folder / "train.parquet", row_group_size=7)  # several row groups
        return folder / "train.parquet"
    if fmt in ("arrow-file", "arrow-stream"):
        path, table = folder / "train.arrow", _table(rows)
        opener = pa.ipc.new_file if fmt == "arrow-file" else pa.ipc.new_stream
        with pa.OSFile(str(path), "wb") as sink, opener(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=5)
        return path
    if fmt == "save_to_disk":
        import datasets

        datasets.Dataset(_table(rows)).save_to_disk(str(folder / "ds"), max_shard_size="1KB")  # several shards
        return folder / "ds"
    if fmt == "jsonl-shards":
        for k in range(3):
            _write_jsonl(folder / f"part-{k:03d}.jsonl", rows[k * 10 : (k + 1) * 10])
        return folder
    assert fmt == "parquet-shards"
    for k in range(3):
        pq.write_table(_table(rows[k * 10 : (k + 1) * 10]), folder / f"part-{k:03d}.parquet")
    return folder


@pytest.mark.parametrize(
    "fmt", ["jsonl", "parquet", "arrow-file", "arrow-stream", "save_to_disk", "jsonl-shards", "parquet-shards"]
)
def test_every_format_gives_the_same_prompts_in_order_under_mapped_field_names(tmp_path: Path, fmt: str) -> None:
    rows = _rows(30)
    prompts = open_prompts(DatasetSpec(_write(fmt, tmp_path, rows), fields=FIELDS)).train

    assert len(prompts) == 30
    got = [(p.prompt_id, p.prompt, p.answer, p.metadata.get("level"), len(p.messages)) for p in prompts]
    assert got == [(f"r{i}", f"{i}+{i}=", str(2 * i), i % 3, 2 if i % 2 else 0) for i in range(30)]
    assert prompts[1].chat() == rows[1]["prompt"]  # a conversation keeps its turns for the chat template
    assert "reward_model" not in prompts[0].metadata and "uid" not in prompts[0].metadata  # mapped, not metadata


def test_a_row_without_an_id_takes_its_line_number_and_a_shard_row_its_file_too(tmp_path: Path) -> None:
    one = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x", "answer": 1}])
    (tmp_path / "shards").mkdir()
    _write_jsonl(tmp_path / "shards" / "b.jsonl", [{"prompt": "y", "answer": 2}])
    (tmp_path / "shards" / "c.jsonl").write_text('\n{"prompt": "z", "answer": 3}\n')

    assert open_prompts(DatasetSpec(one)).train[0].prompt_id == "1"
    assert [p.prompt_id for p in open_prompts(DatasetSpec(tmp_path / "shards")).train] == ["b.jsonl:1", "c.jsonl:2"]


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"question": "1+1="}', "reward_model.ground_truth"),
        ('{"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "2"}}', "prompt"),
        ('{"question": "", "reward_model": {"ground_truth": "2"}}', "question"),
        ("[1, 2]", ""),
        ('{"question": "1+1=", ', ""),
    ],
)
def test_a_bad_row_stops_the_start_naming_file_line_and_field_or_is_skipped_and_counted(
    tmp_path: Path, line: str, field: str
) -> None:
    path = tmp_path / "d.jsonl"
    good = json.dumps({"question": "2+2=", "reward_model": {"ground_truth": "4"}})
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n")

    with pytest.raises(ConfigError) as err:
        open_prompts(DatasetSpec(path, fields=FIELDS))
    assert err.value.field == "rollout.dataset" and err.value.value == f"{path}:3"
    assert (f"field `{field}`" in err.value.rule) == bool(field) and "bad_rows: skip" in err.value.rule

    kept = open_prompts(DatasetSpec(path, fields=FIELDS, bad_rows=BadRows.SKIP))
    assert (len(kept.train), kept.skipped) == (3, 1) and kept.reasons[0].startswith(f"{path}:3: ")
    assert [p.prompt_id for p in kept.train] == ["1", "2", "4"]


def test_a_dataset_with_no_readable_row_is_refused_even_when_bad_rows_are_skipped(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}])
    with pytest.raises(ConfigError, match="no rows it can read"):
        open_prompts(DatasetSpec(path, bad_rows=BadRows.SKIP))


def test_held_out_rows_are_a_seeded_choice_disjoint_from_the_training_rows(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(50)])
    split = open_prompts(DatasetSpec(path, held_out_rows=8, seed=3))
    train, held = [p.prompt for p in split.train], [p.prompt for p in split.held_out]

    assert (len(train), len(held)) == (42, 8) and set(train) | set(held) == {f"p{i}" for i in range(50)}
    assert not set(train) & set(held)
    again = open_prompts(DatasetSpec(path, held_out_rows=8, seed=3))  # rollout and trainer each read it: the same
    assert [p.prompt for p in again.held_out] == held
    assert [p.prompt for p in open_prompts(DatasetSpec(path, held_out_rows=8, seed=4)).held_out] != held
    cursor = PromptCursor(split.train, shuffle=True, seed=0)  # training never sees a held-out row
    assert not {cursor.at(s).prompt for s in range(42 * 3)} & set(held)
    with pytest.raises(ConfigError, match="less than the dataset's 50 rows"):
        open_prompts(DatasetSpec(path, held_out_rows=50))


def test_an_evaluation_without_a_dataset_scores_the_held_out_rows_and_needs_some(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(20)])
    rc = RolloutConfig(dataset=path, held_out_rows=5)
    assert [p.prompt for p in eval_prompts(rc, None, "trainer.eval.dataset")] == [
        p.prompt for p in open_prompts(rc.dataset_spec()).held_out
    ]
    assert len(eval_prompts(rc, path, "trainer.eval.dataset")) == 20  # a named file: every row of it
    with pytest.raises(ConfigError, match=r"rollout\.held_out_rows") as err:
        eval_prompts(RolloutConfig(dataset=path), None, "trainer.eval.dataset")
    assert err.value.field == "trainer.eval.dataset"


def test_a_large_jsonl_is_indexed_not_held_and_rows_are_read_when_asked_for(tmp_path: Path) -> None:
    # 20,000 rows of ~1 kB: the old reader held every row (over 20 MB of Python objects); the index is 8 bytes a row
    path = _write_jsonl(tmp_path / "big.jsonl", [{"prompt": f"{i} " + "x" * 1000, "answer": i} for i in range(20_000)])
    tracemalloc.start()
    try:
        prompts = open_prompts(DatasetSpec(path)).train
        rows = [prompts[i] for i in (19_999, 0, 12_345)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.answer for r in rows] == ["19999", "0", "12345"]
    assert peak < 2_000_000, peak


def test_a_folder_from_a_dataset_dict_names_its_splits_and_unknown_files_name_the_suffixes(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset(_table(_rows(4)))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"a DatasetDict: name one split's folder \(train\)"):
        open_prompts(DatasetSpec(tmp_path / "dd", fields=FIELDS))
    assert len(open_prompts(DatasetSpec(tmp_path / "dd" / "train", fields=FIELDS)).train) == 4

    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ConfigError, match="unknown dataset file type"):
        open_prompts(DatasetSpec(tmp_path / "d.csv"))
    parquet = _write("parquet", tmp_path / "p", _rows(3))
    named = parquet.rename(tmp_path / "p" / "rows.bin")
    assert len(open_prompts(DatasetSpec(named, DatasetFormat.PARQUET, FIELDS)).train) == 3  # the format, set


def test_field_names_must_be_distinct_and_well_formed() -> None:
    with pytest.raises(ConfigError, match="different fields"):
        DatasetFields(prompt="q", answer="q").validate()
    with pytest.raises(ConfigError, match="nested field"):
        DatasetFields(answer="reward_model.").validate()
