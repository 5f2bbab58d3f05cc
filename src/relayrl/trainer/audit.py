"""The trainer's audit trail: which groups each step trained, per rank and incarnation
(``<output_dir>/trained/rank<r>.jsonl``, read by the fault tests), and with ``trainer.dump_episodes`` up to that
many of each step's trained episodes (``trained/episodes/rank<r>.jsonl``: debugging, and the e2e tests'
evidence)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from relayrl.common.stream import StreamEntry


class TrainedAudit:
    def __init__(self, output_dir: Path, rank: int, dump_episodes: int, resumed_from: Path | None) -> None:
        self.incarnation = f"{int(time.time() * 1000)}-{rank}"
        self.resumed_from_step = int(resumed_from.name.split("_")[1]) if resumed_from else 0
        self.dump_episodes = dump_episodes
        (output_dir / "trained").mkdir(parents=True, exist_ok=True)
        self._trained = (output_dir / "trained" / f"rank{rank}.jsonl").open("a")
        self._episodes = None
        if dump_episodes:
            (output_dir / "trained" / "episodes").mkdir(exist_ok=True)
            self._episodes = (output_dir / "trained" / "episodes" / f"rank{rank}.jsonl").open("a")

    def trained(self, step: int, entries: list[StreamEntry]) -> None:
        """``step`` trained ``entries``: one line, and the step's first ``dump_episodes`` episodes (the groups'
        first episodes, then their second ones, ...)."""
        self._trained.write(
            json.dumps(
                {
                    "incarnation": self.incarnation,
                    "step": step,
                    "resumed_from_step": self.resumed_from_step,
                    "groups": [[e.group.group_id, e.group.prompt_seq] for e in entries],
                }
            )
            + "\n"
        )
        self._trained.flush()
        if self._episodes is None:
            return
        groups = [e.group.episodes for e in entries]
        taken = [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]
        for ep in taken[: self.dump_episodes]:
            row = {"step": step, **MessageToDict(ep, preserving_proto_field_name=True)}
            self._episodes.write(json.dumps(row) + "\n")
        self._episodes.flush()

    def close(self) -> None:
        self._trained.close()
        if self._episodes is not None:
            self._episodes.close()
