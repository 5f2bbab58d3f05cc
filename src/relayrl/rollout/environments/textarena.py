"""A single-player TextArena game as a multi-turn :class:`~relayrl.rollout.workflows.api.Environment`.

The game is the row's ``textarena_env`` (a TextArena id such as ``GuessTheNumber-v0``, ``FrozenLake-v0``,
``TowerOfHanoi-v0``; default ``GuessTheNumber-v0``), made without TextArena's observation wrappers (its ``-raw``
variant) so that each observation is only what is new since the model's last turn: ``reset`` returns the game's
prompt, ``step`` plays the model's turn and returns the game's answer to it. The episode's reward is the game's
reward for the player, given at the end (TextArena rewards only finished games); ``truncated`` when the game ended
at its turn limit (TextArena says so only in the ending's reason, which its games word as "... turn limit ...").
Invalid moves follow TextArena's rules (one warning, then the game ends with its penalty).

TextArena seeds Python's global ``random`` in ``reset`` and games draw from it, so calls into the library are
serialised by one lock (the games are cheap; the model's turns are not inside it).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from relayrl.common.dataset import Prompt
from relayrl.rollout.workflows.api import StepResult

DEFAULT_GAME = "GuessTheNumber-v0"
_LIBRARY = threading.Lock()  # TextArena games share the global random generator


def _text(observation: Any, player: int) -> str:
    """The messages of a raw observation ``[(from_id, message, type), ...]`` other than the player's own moves."""
    from textarena.core import ObservationType

    if isinstance(observation, str):
        return observation
    return "\n".join(
        str(msg)
        for sender, msg, kind in observation
        if not (sender == player and kind == ObservationType.PLAYER_ACTION)
    )


class TextArenaEnvironment:
    def __init__(self, game: str = DEFAULT_GAME, **game_kwargs: Any) -> None:
        self.game = game
        self.game_kwargs = game_kwargs
        self.env: Any = None
        self.player = 0
        self.done = False

    def _make(self, seed: int) -> str:
        import textarena as ta
        from textarena.envs.registration import ENV_REGISTRY

        game = self.game if self.game.endswith("-raw") or f"{self.game}-raw" not in ENV_REGISTRY else f"{self.game}-raw"
        with _LIBRARY:
            self.env = ta.make(game, **self.game_kwargs)
            try:
                self.env.reset(num_players=1, seed=seed)
            except AssertionError as exc:  # the states assert their number of players
                raise ValueError(f"{self.game} is not a single-player game: {exc}") from None
            self.player, observation = self.env.get_observation()
        return _text(observation, self.player)

    async def reset(self, row: Prompt, seed: int) -> str:
        self.done = False
        return await asyncio.to_thread(self._make, seed)

    def _step(self, action: str) -> StepResult:
        with _LIBRARY:
            done, info = self.env.step(action)
            if not done:
                self.player, observation = self.env.get_observation()
                return StepResult(observation=_text(observation, self.player), info=dict(info or {}))
            rewards, game_info = self.env.close()
        player_info = dict((game_info or {}).get(self.player, {}))
        truncated = "turn limit" in str(player_info.get("reason", "")).lower()  # TextArena's games all say so
        return StepResult(
            observation="",
            reward=float((rewards or {}).get(self.player, 0.0)),
            done=True,
            truncated=truncated,
            info=player_info,
        )

    async def step(self, action: str) -> StepResult:
        if self.env is None or self.done:
            raise RuntimeError("step() before reset() or after the game ended")
        result = await asyncio.to_thread(self._step, action)
        self.done = result.done
        return result

    async def close(self) -> None:
        self.env = None


def environment(row: Prompt) -> TextArenaEnvironment:
    """The entry point ``textarena``: the game the row names as ``textarena_env`` (default GuessTheNumber-v0)."""
    return TextArenaEnvironment(str(row.metadata.get("textarena_env", DEFAULT_GAME)))
