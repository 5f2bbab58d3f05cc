"""Tasks from ``reasoning-gym`` (PyPI, extra ``envs``): procedural reasoning problems with their own verifiers.

A task is named by ``{"dataset": name, "seed": s, "index": i, "config": {...}}`` (the library's dataset name, its
seed and the item's index, and keyword arguments of its dataset config): the library regenerates the same item
from these anywhere, so a dataset row carries only this reference (its ``reasoning_gym`` key) and the reward
function scores an answer with the library's own ``score_answer`` for that item. Nothing is downloaded.

- :func:`make_dataset` writes relayrl JSONL rows (``prompt``, ``answer``, ``id``, ``reasoning_gym``) for the
  single-turn workflow, scored by :func:`reward` (entry point ``reasoning_gym`` of ``relayrl.rewards``);
- relayrl.tasks.reasoning_gym_env wraps one item as a one-step environment.

The model is asked for its final answer between ``<answer>`` and ``</answer>`` (the library's convention); a
completion without the tags is scored as a whole.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# imported with this module (only when a reasoning-gym reward or environment is chosen): the library takes seconds
# to import, which a verifier worker then spends at start-up, before it is ready, not inside a timed call
import reasoning_gym
from reasoning_gym.utils import extract_answer

INSTRUCTION = "Answer the question directly. Give your final answer between <answer> and </answer> tags."
METADATA_KEY = "reasoning_gym"


@dataclass(frozen=True)
class TaskRef:
    dataset: str
    seed: int
    index: int
    config: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: Any) -> TaskRef:
        """From a row's ``reasoning_gym`` metadata (a dict, or its JSON text); ValueError naming what is wrong."""
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, Mapping) or not isinstance(value.get("dataset"), str):
            raise ValueError(f"'{METADATA_KEY}' must be an object with a string 'dataset'")
        config = value.get("config") or {}
        if not isinstance(config, Mapping):
            raise ValueError(f"'{METADATA_KEY}.config' must be an object")
        return cls(value["dataset"], int(value.get("seed", 0)), int(value.get("index", 0)), dict(config))

    def to_json(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "seed": self.seed, "index": self.index, "config": dict(self.config)}


@functools.lru_cache(maxsize=64)
def _dataset(name: str, seed: int, size: int, config_json: str) -> Any:
    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def _size(index: int) -> int:
    """The dataset size the item at ``index`` is generated in (a power of two, so that datasets are shared)."""
    size = 16
    while size <= index:
        size *= 2
    return size


def dataset_of(ref: TaskRef) -> Any:
    return _dataset(ref.dataset, ref.seed, _size(ref.index), json.dumps(dict(ref.config), sort_keys=True))


def entry(ref: TaskRef) -> dict[str, Any]:
    """The library's item (question, answer, metadata) for ``ref``."""
    return dict(dataset_of(ref)[ref.index])


def final_answer(completion: str) -> str:
    """The text between the last ``<answer>`` tags, else the whole completion (stripped)."""
    found = extract_answer(completion)
    return (found if found is not None else completion).strip()


def score(ref: TaskRef, completion: str) -> float:
    """The library's score (0..1) of ``completion`` for the item ``ref``."""
    return float(dataset_of(ref).score_answer(final_answer(completion), entry(ref)))


def make_dataset(path: Path, dataset: str, size: int, seed: int = 0, config: Mapping[str, Any] | None = None) -> int:
    """Write ``size`` items of the reasoning-gym ``dataset`` as relayrl JSONL rows; returns the count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for index in range(size):
            ref = TaskRef(dataset, seed, index, dict(config or {}))
            item = entry(ref)
            f.write(
                json.dumps(
                    {
                        "id": f"{dataset}-{seed}-{index}",
                        "prompt": f"{item['question']}\n{INSTRUCTION}",
                        "answer": str(item.get("answer") or ""),
                        METADATA_KEY: ref.to_json(),
                    }
                )
                + "\n"
            )
    return size


def reward(inp: Any) -> float:
    """Reward function (entry point ``reasoning_gym``): the library's score of the completion for the row's item.
    ``inp`` is the reward service's RewardInput (not imported here: rollout's environment shares this module, and
    services never import one another)."""
    if METADATA_KEY not in inp.metadata:
        raise ValueError(f"the dataset row has no '{METADATA_KEY}' task reference (see make_dataset)")
    return score(TaskRef.parse(inp.metadata[METADATA_KEY]), inp.completion)
