"""The trainer's inference watchdog (relayrl.trainer.served.watch_inference) re-pushes the current weights to
a replica that serves an older version, but not to replicas that only look behind because a publication began
while they were asked (that publication reaches them itself)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from relayrl.trainer.served import watch_inference


@dataclass
class _Publication:
    """What the watchdog reads of VersionPublication; ``overlap`` starts a publication during each ask."""

    overlap: bool
    weight_version: int = 5
    publishing: bool = False
    inference_targets: list[str] = field(default_factory=lambda: ["a", "b"])
    pushes: list[Any] = field(default_factory=list)
    asked: int = 0

    async def lagging_replicas(self) -> list[str]:
        self.asked += 1
        if self.overlap:  # the loop allocated version 6 and began pushing it while the replicas answered 5
            self.weight_version += 1
            self.publishing = True
        return ["a"]

    async def allocate_and_push(self, step: int, floor: int, only: list[str] | None) -> int:
        self.pushes.append((step, floor, only))
        return floor + 1


async def _watch(publication: _Publication, rounds: int) -> None:
    task = asyncio.create_task(watch_inference(publication, lambda: 3, lambda: False, interval_s=0.0))  # type: ignore[arg-type]
    while publication.asked < rounds:
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_replica_that_serves_an_older_version_gets_the_current_weights_pushed_to_it_alone() -> None:
    publication = _Publication(overlap=False)
    await _watch(publication, 1)
    assert publication.pushes[0] == (3, 5, ["a"])


async def test_replicas_that_look_behind_because_a_publication_began_meanwhile_get_no_extra_push() -> None:
    publication = _Publication(overlap=True)
    await _watch(publication, 1)
    publication.publishing = False  # that publication ended: the next round asks again
    await _watch(publication, 2)
    assert publication.pushes == []
