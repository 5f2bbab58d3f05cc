"""A reasoning-gym item as a one-step :class:`~relayrl.rollout.workflows.api.Environment`.

``reset`` shows the item's question (a system message asking for the answer between ``<answer>`` tags, then the
question); ``step`` scores the model's answer with the library's own verifier and ends the episode. The item is the
row's ``reasoning_gym`` reference when it has one (rows written by relayrl.tasks.reasoning_gym.make_dataset), else
the item ``seed`` of the factory's dataset (so that a plain row list and a seed per episode give distinct tasks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from relayrl.common.dataset import Prompt
from relayrl.rollout.workflows.api import StepResult
from relayrl.tasks.reasoning_gym import INSTRUCTION, METADATA_KEY, TaskRef, entry, final_answer, score


class ReasoningGymEnvironment:
    def __init__(self, dataset: str = "basic_arithmetic", config: Mapping[str, Any] | None = None) -> None:
        self.dataset = dataset
        self.config = dict(config or {})
        self.ref: TaskRef | None = None
        self.done = False

    async def reset(self, row: Prompt, seed: int) -> list[dict[str, str]]:
        if METADATA_KEY in row.metadata:
            self.ref = TaskRef.parse(row.metadata[METADATA_KEY])
        else:
            self.ref = TaskRef(self.dataset, 0, seed, self.config)
        item = await asyncio.to_thread(entry, self.ref)
        self.done = False
        return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": str(item["question"])}]

    async def step(self, action: str) -> StepResult:
        if self.ref is None or self.done:
            raise RuntimeError("step() before reset() or after the episode ended")
        ref = self.ref
        value = await asyncio.to_thread(score, ref, action)
        self.done = True
        return StepResult(
            observation="",
            reward=value,
            done=True,
            info={"answer": final_answer(action), "dataset": ref.dataset, "index": ref.index},
        )

    async def close(self) -> None:
        self.ref = None


def environment(row: Prompt) -> ReasoningGymEnvironment:
    """The entry point ``reasoning_gym``: the row's item (see the module's docstring); a row without a reference
    names the dataset in its metadata as ``reasoning_gym_dataset`` (default ``basic_arithmetic``)."""
    return ReasoningGymEnvironment(str(row.metadata.get("reasoning_gym_dataset", "basic_arithmetic")))
