"""The multi-turn and tool workflows against a scripted model: token-in/token-out sequences, loss masks, per-token
weight versions, limits and finish reasons, environment and tool failures (relayrl.rollout.workflows)."""

from __future__ import annotations

import asyncio
import string
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from relayrl.common.dataset import Prompt
from relayrl.common.episodes import Limits, validate_group
from relayrl.common.pb import episode_pb2, inference_pb2, reward_pb2
from relayrl.common.reward_metadata import decode_metadata
from relayrl.config.rollout import RolloutConfig, ToolFormat
from relayrl.config.typed import ConfigError
from relayrl.reward.api import RewardInput
from relayrl.rollout.workflows.api import GroupFailed, StepResult, WorkflowContext
from relayrl.rollout.workflows.loader import build_workflow
from relayrl.rollout.workflows.multi_turn import MultiTurnWorkflow
from relayrl.tasks.calculator import reward as calculator_reward

VOCAB = string.printable
END = episode_pb2.EpisodeEnd


def ids(text: str) -> list[int]:
    return [VOCAB.index(ch) + 3 for ch in text]


@dataclass
class ScriptedModel:
    """The inference client's ``generate`` with a scripted answer per turn (by episode index and turn), a
    character tokenizer, and a weight version that the test may change between calls."""

    turns: Sequence[str]
    version: int = 1
    prompts: list[list[int]] = field(default_factory=list)
    on_call: Any = None

    async def generate(
        self,
        prompt: Any,
        sampling: inference_pb2.SamplingParams,
        timeout_s: float = 120.0,
        request_id: str = "",
        suffix_text: str = "",
    ) -> inference_pb2.GenerateResponse:
        prompt_ids = ids(prompt) if isinstance(prompt, str) else list(prompt)
        prompt_ids += ids(suffix_text)
        self.prompts.append(prompt_ids)
        turn = int(request_id.rsplit("-", 1)[1])
        text = self.turns[min(turn, len(self.turns) - 1)]
        for stop in sampling.stop:  # the server cuts a completion after its first stop string
            if stop in text:
                text = text[: text.index(stop) + len(stop)]
        token_ids = ids(text)[: sampling.max_new_tokens]
        response = inference_pb2.GenerateResponse(
            prompt_token_ids=prompt_ids,
            samples=[
                inference_pb2.Sample(
                    token_ids=token_ids,
                    logprobs=[-0.5] * len(token_ids),
                    weight_versions=[self.version] * len(token_ids),
                    text="".join(VOCAB[i - 3] for i in token_ids),
                    finish_reason=1,
                )
            ],
        )
        if self.on_call is not None:
            self.on_call(self)
        return response


class InProcessReward:
    """The reward client's ``score_batch`` calling the calculator task's reward function in process."""

    def __init__(self) -> None:
        self.requests: list[reward_pb2.ScoreRequest] = []

    async def score_batch(
        self, requests: Sequence[reward_pb2.ScoreRequest], timeout_s: float = 60.0
    ) -> reward_pb2.ScoreBatchResponse:
        self.requests += requests
        out = []
        for r in requests:
            res = calculator_reward(RewardInput(r.prompt, r.completion, r.reference, decode_metadata(r.metadata)))
            out.append(
                reward_pb2.ScoreResponse(
                    episode_id=r.episode_id,
                    score=res.score,
                    components=dict(res.components),
                    status=reward_pb2.SCORE_STATUS_OK,
                )
            )
        return reward_pb2.ScoreBatchResponse(responses=out)


ROW = Prompt("12+35", "12+35=", "47")


def _cfg(**kw: Any) -> RolloutConfig:
    base: dict[str, Any] = {
        "workflow": "tools",
        "tools": ["relayrl.tasks.calculator:c"],
        "tool_format": ToolFormat.TAGGED,
        "max_new_tokens": 14,
        "max_episode_tokens": 48,
        "max_turns": 3,
        "group_size": 2,
    }
    cfg = RolloutConfig(**{**base, **kw})
    cfg.validate()
    return cfg


async def _run(
    cfg: RolloutConfig, model: ScriptedModel, row: Prompt = ROW, reward: InProcessReward | None = None
) -> list[episode_pb2.Episode]:
    workflow, env = build_workflow(cfg)
    ctx = WorkflowContext(
        inference=model,
        reward=reward or InProcessReward(),
        group_id="g",
        group_size=cfg.group_size,
        producer_id="test",
        created_at=time.time(),
        config=cfg,
        environment=env,
    )
    return await workflow(row, ctx)  # type: ignore[arg-type]


async def test_tool_episode_is_one_token_sequence_with_observation_tokens_masked() -> None:
    model = ScriptedModel(["<c>12+35</c>", "47"])

    episodes = await _run(_cfg(), model)

    ep = episodes[0]
    call, obs, answer = ids("<c>12+35</c>"), ids("<r>47</r>"), ids("47")
    assert list(ep.prompt_token_ids) == ids("12+35=")
    assert list(ep.completion_token_ids) == call + obs + answer
    assert list(ep.loss_mask) == [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    assert list(ep.behaviour_logprobs) == [-0.5] * len(call) + [0.0] * len(obs) + [-0.5] * len(answer)
    # the second turn's prompt is the exact ids of the first turn plus the observation's: never re-rendered
    assert model.prompts[-1] == ids("12+35=") + call + obs
    assert (ep.turns, ep.tool_calls, ep.tool_errors, ep.episode_end) == (2, 1, 0, END.EPISODE_END_DONE)
    assert ep.reward == pytest.approx(1.0, abs=1e-12) and ep.reward_components["exact"] == 1.0
    assert ep.completion_text == "<c>12+35</c><r>47</r>47"
    group = episode_pb2.EpisodeGroup(group_id="g", episodes=episodes)
    assert validate_group(group, Limits(len(VOCAB) + 3, 48, 1)) is None


async def test_weight_update_between_turns_stamps_each_turn_with_its_version() -> None:
    def update_after_first_turn(model: ScriptedModel) -> None:
        model.version = 2  # a weight update lands between two turns of the episode

    model = ScriptedModel(["<c>12+35</c>", "47"], on_call=update_after_first_turn)

    ep = (await _run(_cfg(group_size=1), model))[0]

    n_call, n_obs = len(ids("<c>12+35</c>")), len(ids("<r>47</r>"))
    # observation tokens carry the version of the model turn before them; staleness counts from the oldest (1)
    assert list(ep.token_weight_versions) == [1] * (n_call + n_obs) + [2, 2]
    assert min(ep.token_weight_versions) == 1 and max(ep.token_weight_versions) == 2


async def test_model_that_keeps_calling_tools_ends_at_max_turns() -> None:
    ep = (await _run(_cfg(max_turns=2, max_tool_calls=5), ScriptedModel(["<c>1+1</c>"])))[0]

    assert ep.episode_end == END.EPISODE_END_MAX_TURNS and ep.turns == 2 and ep.tool_calls == 2
    assert list(ep.loss_mask)[-1] == 1  # the episode ends with the model's turn, not with an observation


async def test_calls_beyond_max_tool_calls_end_the_episode_without_running() -> None:
    ep = (await _run(_cfg(max_turns=4, max_tool_calls=1), ScriptedModel(["<c>1+1</c>"])))[0]

    assert ep.episode_end == END.EPISODE_END_MAX_TOOL_CALLS and ep.tool_calls == 1 and ep.turns == 2


async def test_episode_never_exceeds_max_episode_tokens() -> None:
    # 12 tokens of call, then the 9 of "<r>22</r>" leave no room for another turn within 21
    ep = (
        await _run(
            _cfg(max_turns=10, max_tool_calls=10, max_new_tokens=14, max_episode_tokens=21),
            ScriptedModel(["<c>11+11</c>"]),
        )
    )[0]

    assert ep.episode_end == END.EPISODE_END_MAX_TOKENS
    assert len(ep.completion_token_ids) <= 21 and ep.turns == 1


async def test_failed_tool_call_is_shown_to_the_model_and_counted() -> None:
    model = ScriptedModel(["<c>12+</c>", "0"])

    ep = (await _run(_cfg(group_size=1, max_episode_tokens=200), model))[0]

    assert ep.tool_calls == 1 and ep.tool_errors == 1
    assert "<r>error: SyntaxError" in ep.completion_text
    assert ep.reward_status == reward_pb2.SCORE_STATUS_OK  # the model's mistake: scored, not an infrastructure error


async def test_answer_without_a_call_is_scored_at_once() -> None:
    ep = (await _run(_cfg(group_size=1), ScriptedModel(["47"])))[0]

    assert (ep.turns, ep.tool_calls, ep.episode_end) == (1, 0, END.EPISODE_END_DONE)
    assert ep.reward_components["answer"] == 1.0 and ep.reward_components["call"] < 0.2


class CountdownEnv:
    """Rewards 1 per step whose action is "a"; done after three steps; ``fail_at`` raises in that step."""

    def __init__(self, fail_at: int = -1, sleep_s: float = 0.0) -> None:
        self.steps, self.fail_at, self.sleep_s, self.closed = 0, fail_at, sleep_s, False

    async def reset(self, row: Prompt, seed: int) -> str:
        return row.prompt

    async def step(self, action: str) -> StepResult:
        self.steps += 1
        await asyncio.sleep(self.sleep_s)
        if self.steps == self.fail_at:
            raise RuntimeError("the game server crashed")
        return StepResult(observation=" ok ", reward=float(action == "a"), done=self.steps == 3)

    async def close(self) -> None:
        self.closed = True


async def _env_run(env: CountdownEnv, **kw: Any) -> episode_pb2.Episode:
    cfg = RolloutConfig(
        workflow="multi_turn",
        environment="tests.unit.rollout.test_workflows:CountdownEnv",
        group_size=1,
        max_new_tokens=2,
        max_turns=5,
        **kw,
    )
    ctx = WorkflowContext(
        inference=ScriptedModel(["a"]),
        reward=None,
        group_id="g",
        group_size=1,
        producer_id="t",
        created_at=time.time(),
        config=cfg,
    )
    return (await MultiTurnWorkflow(lambda row: env)(Prompt("p", "go", ""), ctx))[0]  # type: ignore[arg-type]


async def test_environment_rewards_are_summed_over_its_steps() -> None:
    env = CountdownEnv()

    ep = await _env_run(env)

    assert ep.reward == 3.0 and ep.turns == 3 and ep.episode_end == END.EPISODE_END_DONE and env.closed
    assert list(ep.loss_mask) == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]


async def test_environment_failure_marks_the_episode_like_a_reward_error() -> None:
    env = CountdownEnv(fail_at=2)

    ep = await _env_run(env)

    assert ep.episode_end == END.EPISODE_END_ENV_ERROR and ep.reward_status == reward_pb2.SCORE_STATUS_ERROR
    assert "the game server crashed" in ep.reward_error and env.closed


async def test_slow_environment_ends_the_episode_at_its_timeout() -> None:
    ep = await _env_run(CountdownEnv(sleep_s=0.2), episode_timeout_s=0.3)

    assert ep.episode_end == END.EPISODE_END_TIMEOUT and ep.turns == 2


async def test_environment_that_cannot_reset_fails_the_group() -> None:
    class Broken(CountdownEnv):
        async def reset(self, row: Prompt, seed: int) -> str:
            raise OSError("no display")

    with pytest.raises(GroupFailed, match="no display"):
        await _env_run(Broken())


async def scripted_user_workflow(row: Prompt, ctx: WorkflowContext) -> list[episode_pb2.Episode]:
    return [
        episode_pb2.Episode(group_id=ctx.group_id, prompt_id=row.prompt_id, sample_index=i)
        for i in range(ctx.group_size)
    ]


def test_user_workflow_loads_from_module_function() -> None:
    workflow, _ = build_workflow(RolloutConfig(workflow="tests.unit.rollout.test_workflows:scripted_user_workflow"))

    assert workflow is scripted_user_workflow


@pytest.mark.parametrize(
    ("kw", "field_name"),
    [
        ({"workflow": "multi_turn"}, "environment"),
        ({"workflow": "tools"}, "tools"),
        ({"workflow": "tools", "tools": ["x:y"], "max_episode_tokens": 4, "max_new_tokens": 8}, "max_episode_tokens"),
        ({"workflow": " "}, "workflow"),
        ({"workflow": "agent"}, "agent.function"),
    ],
)
def test_incomplete_workflow_config_is_refused_naming_the_field(kw: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ConfigError) as err:
        RolloutConfig(**kw).validate()

    assert err.value.field == field_name


def test_unloadable_tool_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError) as err:
        build_workflow(RolloutConfig(workflow="tools", tools=["relayrl.tasks.no_such_module:c"]))

    assert err.value.field == "rollout.tools"


async def test_hermes_tool_calls_run_with_json_arguments() -> None:
    model = ScriptedModel(['<tool_call>{"name": "c", "arguments": {"expression": "12+35"}}</tool_call>', "47"])

    ep = (
        await _run(_cfg(tool_format=ToolFormat.HERMES, max_new_tokens=80, max_episode_tokens=200, group_size=1), model)
    )[0]

    assert ep.tool_calls == 1 and ep.tool_errors == 0
    assert "<tool_response>\n47\n</tool_response>" in ep.completion_text
