"""Multi-turn counters of the rollout service: turns, tool calls and errors, and how episodes ended."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from relayrl.common.episodes import end_name
from relayrl.common.pb import episode_pb2


class TurnCounters:
    def __init__(self) -> None:
        self.episodes = 0
        self.turns = 0
        self.tool_calls = 0
        self.tool_errors = 0
        self.ends: Counter[str] = Counter()

    def count(self, episodes: Sequence[episode_pb2.Episode]) -> None:
        for ep in episodes:
            self.episodes += 1
            self.turns += max(ep.turns, 1)
            self.tool_calls += ep.tool_calls
            self.tool_errors += ep.tool_errors
            self.ends[end_name(ep.episode_end)] += 1

    def state(self) -> dict[str, int]:
        return {
            "episode_turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "env_errors": self.ends["env_error"],
            **{f"episodes_end_{name}": n for name, n in sorted(self.ends.items())},
        }
