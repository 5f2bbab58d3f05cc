"""Environment adapters over real environments of two PyPI libraries (reasoning-gym, TextArena), each driven by a
real model turn loop against an inference server on port 0 (a minimal loop written here: model turn, environment
step, observation as the next user message), and the reasoning-gym reward bridge through the reward service."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from relayrl.client import InferenceClient, RewardClient
from relayrl.common.dataset import Prompt, open_prompts
from relayrl.common.pb import inference_pb2, reward_pb2
from relayrl.config.dataset import DatasetSpec
from relayrl.rollout.environments.textarena import TextArenaEnvironment
from relayrl.rollout.workflows.api import ENVIRONMENT_ENTRY_POINT_GROUP, Environment, StepResult
from relayrl.tasks.reasoning_gym import TaskRef, make_dataset
from relayrl.tasks.reasoning_gym_env import ReasoningGymEnvironment
from tests.integration.helpers import inference_server, reward_server

pytestmark = pytest.mark.integration
ROW = Prompt("r0", "play", "")


@pytest.fixture(scope="module")
def game_model_dir(chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model with room for a game's prompt (its 400-token vocabulary spells TextArena's rules in
    ~650 tokens): the same weights, a longer context (rotary positions need no new weights)."""
    out = tmp_path_factory.mktemp("models") / "game"
    shutil.copytree(chat_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (out / "config.json").write_text(json.dumps(config))
    return out


async def _turn_loop(
    env: Environment,
    client: InferenceClient,
    seed: int,
    max_turns: int = 8,
) -> tuple[list[dict[str, str]], list[StepResult]]:
    """Model turns until the environment ends the episode: each observation becomes the next user message."""
    first = await env.reset(ROW, seed)
    messages = list(first) if isinstance(first, list) else [{"role": "user", "content": first}]
    results: list[StepResult] = []
    try:
        for _ in range(max_turns):
            gen = await client.generate(
                messages, inference_pb2.SamplingParams(n=1, temperature=1.0, max_new_tokens=8, seed=seed), timeout_s=30
            )
            action = gen.samples[0].text
            result = await env.step(action)
            results.append(result)
            messages.append({"role": "assistant", "content": action})
            if result.done or result.truncated:
                break
            messages.append({"role": "user", "content": result.observation})
    finally:
        await env.close()
    return messages, results


def test_adapters_are_registered_as_environment_entry_points() -> None:
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENVIRONMENT_ENTRY_POINT_GROUP)}

    assert names["reasoning_gym"] == "relayrl.tasks.reasoning_gym_env:environment"
    assert names["textarena"] == "relayrl.rollout.environments.textarena:environment"


async def test_reasoning_gym_item_scored_by_the_librarys_verifier_after_a_model_turn(chat_model_dir: Path) -> None:
    import reasoning_gym

    env = ReasoningGymEnvironment("basic_arithmetic")

    async def go() -> tuple[list[dict[str, str]], list[StepResult]]:
        async with inference_server(chat_model_dir) as (target, _), InferenceClient(target) as client:
            return await _turn_loop(env, client, seed=3)

    messages, results = await go()

    library = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=16)
    item = library[3]
    assert messages[1] == {"role": "user", "content": item["question"]}
    [result] = results  # one step: the answer ends the episode
    assert result.done and not result.truncated and result.observation == ""
    assert result.reward == library.score_answer(messages[-1]["content"].strip(), item)


async def test_reasoning_gym_correct_answer_scores_one_and_a_wrong_one_less() -> None:
    async def go(answer_of: Any) -> StepResult:
        env = ReasoningGymEnvironment("basic_arithmetic")
        await env.reset(ROW, 5)
        assert env.ref is not None
        from relayrl.tasks.reasoning_gym import entry

        result = await env.step(answer_of(entry(env.ref)))
        await env.close()
        return result

    right = await go(lambda item: f"Let me see. <answer>{item['answer']}</answer>")
    wrong = await go(lambda item: "<answer>not a number</answer>")

    assert right.reward == 1.0 and right.done
    assert wrong.reward < 1.0 and wrong.done


async def test_reasoning_gym_rows_are_scored_by_the_reward_service(tmp_path: Path) -> None:
    path = tmp_path / "rg.jsonl"
    make_dataset(path, "basic_arithmetic", size=4, seed=7)
    rows = open_prompts(DatasetSpec(path)).train

    async def go() -> reward_pb2.ScoreBatchResponse:
        async with reward_server("reasoning_gym", workers=1) as (target, _), RewardClient(target) as client:
            requests = [
                reward_pb2.ScoreRequest(  # as rollout sends them: metadata values JSON-encoded
                    episode_id=f"e{i}",
                    prompt=row.prompt,
                    completion=text,
                    reference=row.answer,
                    metadata={k: json.dumps(v) for k, v in row.metadata.items()},
                )
                for i, (row, text) in enumerate(
                    [(rows[0], f"<answer>{rows[0].answer}</answer>"), (rows[1], "<answer>-123456789</answer>")]
                )
            ]
            return await client.score_batch(requests, timeout_s=60)

    resp = await go()

    assert len(rows) == 4 and TaskRef.parse(rows[0].metadata["reasoning_gym"]).seed == 7
    assert [r.status for r in resp.responses] == [reward_pb2.SCORE_STATUS_OK] * 2
    assert resp.responses[0].score == 1.0 and resp.responses[1].score < 1.0


async def test_textarena_game_played_by_the_model_until_the_game_ends(game_model_dir: Path) -> None:
    env = TextArenaEnvironment("GuessTheNumber-v0")

    async def go() -> tuple[list[dict[str, str]], list[StepResult]]:
        async with inference_server(game_model_dir) as (target, _), InferenceClient(target) as client:
            return await _turn_loop(env, client, seed=1, max_turns=12)

    messages, results = await go()

    assert "Guess The Number" in messages[0]["content"]
    # a random tiny model writes no "[n]": TextArena warns once, then ends the game with its penalty
    assert [r.done for r in results] == [False, True]
    assert "invalid move" in results[0].observation.lower()
    assert results[-1].info.get("invalid_move") is True and not results[-1].truncated
    assert env.env is None  # closed


async def test_textarena_game_won_by_binary_search_and_cut_at_its_turn_limit() -> None:
    async def play(guesses: Any, max_turns: int) -> list[StepResult]:
        env = TextArenaEnvironment("GuessTheNumber-v0", max_turns=max_turns)
        await env.reset(ROW, 11)
        results: list[StepResult] = []
        while not (results and results[-1].done):
            results.append(await env.step(f"My guess: [{guesses(results)}]"))
        await env.close()
        return results

    def binary_search(results: list[StepResult]) -> int:
        low, high = 1, 20
        for r, guess in zip(results, guessed, strict=False):
            low, high = (guess + 1, high) if "higher" in r.observation else (low, guess - 1)
        guessed.append((low + high) // 2)
        return guessed[-1]

    guessed: list[int] = []
    won = await play(binary_search, max_turns=10)
    target = guessed[-1]
    wrong = [n for n in range(1, 21) if n != target]
    cut = await play(lambda results: wrong[len(results)], max_turns=3)

    assert won[-1].done and won[-1].reward == 1.0 and not won[-1].truncated
    assert len(won) > 1 and all(not r.done and r.observation.startswith("The target number is") for r in won[:-1])
    assert cut[-1].done and cut[-1].truncated and cut[-1].reward < 1.0
    assert all(not r.done for r in cut[:-1])
