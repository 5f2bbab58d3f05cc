"""Local data of the lm-eval tasks beside this file (``custom_dataset: !function relayrl_data.<name>``): JSONL
files read from this folder, so the harness downloads nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _split(name: str) -> Any:
    import datasets

    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def arith_choice(**_: Any) -> Any:
    return _split("arith_choice.jsonl")


def arith_gen(**_: Any) -> Any:
    return _split("arith_gen.jsonl")
