"""Black-box agents through the session endpoint: small agent loops written against the official ``openai`` client
talk to a real inference server (tiny chat model, port 0) through AgentWorkflow's proxy; their sessions become
episodes whose tokens are exactly what inference saw and sampled."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from relayrl.client import InferenceClient, RewardClient
from relayrl.common.dataset import Prompt
from relayrl.common.model import chat_token_ids, load_model, load_tokenizer
from relayrl.common.pb import episode_pb2, reward_pb2
from relayrl.config.agents import AgentConfig, AgentReward
from relayrl.config.model import ModelConfig
from relayrl.rollout.workflows.agent import AgentWorkflow
from relayrl.rollout.workflows.agent_proxy import Sampling
from relayrl.rollout.workflows.api import WorkflowContext
from relayrl.trainer.learner import pack
from relayrl.trainer.logprobs import token_logprobs
from tests.integration.helpers import inference_server, reward_server

pytestmark = pytest.mark.integration
ROW = Prompt("p1", "What is 17 + 25?", "42")
SAMPLING = Sampling(temperature=0.9, generate_timeout_s=30)


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=30, max_retries=0)


async def multi_turn_agent(base_url: str, row: Prompt) -> float:
    """Three turns: ask, then twice more with the model's own answers kept in the history. Seeded: a random model
    may sample a special token (say ``<|endoftext|>``) that the answer's text leaves out, and then the history the
    agent sends back honestly differs from what the model saw (a new episode starts); seed 1 samples none."""
    client = _client(base_url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": row.prompt}]
    for turn in range(3):
        r = await client.chat.completions.create(
            model="any",
            messages=messages,
            max_tokens=5,  # type: ignore[arg-type]
            temperature=0.9,
            logprobs=True,
            seed=1,
        )
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content or ""},
            {"role": "user", "content": f"Try again ({turn})"},
        ]
    return 0.5


async def rewriting_agent(base_url: str, row: Prompt) -> float:
    """Two calls; the second replaces the model's answer in the history: the prefixes differ."""
    client = _client(base_url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": row.prompt}]
    await client.chat.completions.create(model="any", messages=messages, max_tokens=4)  # type: ignore[arg-type]
    messages += [{"role": "assistant", "content": "(summarised)"}, {"role": "user", "content": "Again"}]
    await client.chat.completions.create(model="any", messages=messages, max_tokens=4)  # type: ignore[arg-type]
    return 1.0


async def _run(
    model_dir: Path,
    agent: Callable[[str, Prompt], Awaitable[Any]],
    group_size: int = 2,
    reward_target: str = "",
    after: Callable[[], Awaitable[None]] | None = None,
    **cfg: Any,
) -> tuple[list[episode_pb2.Episode], AgentWorkflow]:
    """One group of ``agent`` sessions through AgentWorkflow; ``after`` runs once the group is done, while the
    proxy still serves."""
    workflow = AgentWorkflow(
        AgentConfig(**cfg), load_tokenizer(model_dir), SAMPLING, max_episode_tokens=64, agent=agent
    )  # type: ignore[arg-type]
    async with inference_server(model_dir) as (target, _), InferenceClient(target) as inference:
        reward = RewardClient(reward_target) if reward_target else None
        ctx = WorkflowContext(
            inference=inference,
            reward=reward,
            group_id="g1",
            group_size=group_size,
            producer_id="test",
            created_at=time.time(),
        )
        try:
            episodes = await workflow(ROW, ctx)
            if after is not None:
                await after()
            return episodes, workflow
        finally:
            await workflow.close()
            if reward is not None:
                await reward.close()


async def test_multi_turn_session_becomes_one_episode_with_the_tokens_inference_sampled(chat_model_dir: Path) -> None:
    tok = load_tokenizer(chat_model_dir)

    episodes, workflow = await _run(chat_model_dir, multi_turn_agent)

    assert len(episodes) == 2 and workflow.proxy.calls_served == 6  # one episode per session of 3 calls
    model = load_model(ModelConfig(path=chat_model_dir))
    for i, ep in enumerate(episodes):
        assert ep.group_size == 2 and ep.sample_index == i and ep.reward == 0.5
        assert ep.reward_status == reward_pb2.SCORE_STATUS_OK
        assert list(ep.prompt_token_ids) == chat_token_ids(tok, [{"role": "user", "content": ROW.prompt}])
        n = len(ep.completion_token_ids)
        assert len(ep.behaviour_logprobs) == len(ep.token_weight_versions) == len(ep.loss_mask) == n
        assert 3 <= sum(ep.loss_mask) <= 15 and set(ep.token_weight_versions) == {0}
        gaps = tok.decode([t for t, m in zip(ep.completion_token_ids, ep.loss_mask, strict=True) if m == 0])
        assert "Try again (0)" in gaps and "Try again (1)" in gaps and "Try again (2)" not in gaps
        assert all(lp == 0.0 for lp, m in zip(ep.behaviour_logprobs, ep.loss_mask, strict=True) if m == 0)
        # the model itself scores the episode's sampled tokens as inference did: the ids in the episode are the
        # ids the model conditioned on at every turn (a re-tokenised history would shift these logprobs)
        prompt, completion = list(ep.prompt_token_ids), list(ep.completion_token_ids)
        batch = pack([prompt], [completion], None, None, [0.9], tok.pad_token_id, torch.device("cpu"))
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        want = token_logprobs(logits, batch.targets, batch.temperature)[0, len(prompt) - 1 : len(prompt) - 1 + n]
        got = torch.tensor(list(ep.behaviour_logprobs))
        mask = torch.tensor(list(ep.loss_mask), dtype=torch.bool)
        # float32, KV-cache decode vs one forward over the whole transcript: summation order only
        assert (got[mask] - want[mask]).abs().max().item() <= 1e-4


async def test_streamed_chat_and_completions_are_recorded_as_the_tokens_logprobs_and_versions_they_sent(
    chat_model_dir: Path,
) -> None:
    sent: dict[str, dict[str, Any]] = {}

    async def streaming_agent(base_url: str, row: Prompt) -> float:
        client = _client(base_url)
        chat = await client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": row.prompt}],
            max_tokens=5,
            temperature=0.9,
            logprobs=True,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        got: dict[str, Any] = {"text": "", "logprobs": [], "versions": [], "finish": None, "usage": None}
        async for chunk in chat:
            got["usage"] = chunk.usage or got["usage"]
            for choice in chunk.choices:
                got["text"] += choice.delta.content or ""
                got["logprobs"] += [t.logprob for t in (choice.logprobs.content or [])] if choice.logprobs else []
                got["versions"] += (choice.model_extra or {}).get("weight_versions", [])
                got["finish"] = choice.finish_reason or got["finish"]
        sent["chat"] = got
        plain = await client.completions.create(model="any", prompt="Once upon", max_tokens=4, logprobs=0, seed=2)
        streamed = await client.completions.create(
            model="any", prompt="A time", max_tokens=4, logprobs=0, seed=3, stream=True
        )
        got = {"text": "", "logprobs": [], "versions": [], "finish": None}
        async for chunk in streamed:
            for c in chunk.choices:
                got["text"] += c.text
                got["logprobs"] += list(c.logprobs.token_logprobs or []) if c.logprobs else []
                got["versions"] += (c.model_extra or {}).get("weight_versions", [])
                got["finish"] = c.finish_reason or got["finish"]
        sent["completion"] = got
        sent["plain"] = {"text": plain.choices[0].text, "logprobs": plain.choices[0].logprobs.token_logprobs}
        return 1.0

    tok = load_tokenizer(chat_model_dir)
    episodes, workflow = await _run(chat_model_dir, streaming_agent, group_size=1)

    assert workflow.proxy.calls_served == 3 and len(episodes) == 3  # three unrelated prompts: three episodes
    by_prompt = {tok.decode(list(ep.prompt_token_ids)): ep for ep in episodes}
    chat_ep = next(ep for text, ep in by_prompt.items() if ROW.prompt in text)
    streamed_ep, plain_ep = by_prompt["A time"], by_prompt["Once upon"]
    chat, completion = sent["chat"], sent["completion"]
    assert chat["usage"].completion_tokens == len(chat_ep.completion_token_ids) == len(chat["logprobs"])
    assert chat["finish"] in ("stop", "length") and completion["finish"] in ("stop", "length")
    for got, ep in ((chat, chat_ep), (completion, streamed_ep), (sent["plain"], plain_ep)):
        assert set(ep.loss_mask) == {1}
        # the floats the stream sent (float32 from inference, through JSON) are the ones the episode recorded
        assert got["logprobs"] == pytest.approx(list(ep.behaviour_logprobs), abs=1e-6)
    for got, ep in ((chat, chat_ep), (completion, streamed_ep)):
        assert got["versions"] == list(ep.token_weight_versions) == [0] * len(ep.completion_token_ids)
    assert completion["text"] == tok.decode(list(streamed_ep.completion_token_ids), skip_special_tokens=True)


async def test_rewritten_history_gives_one_episode_per_call(chat_model_dir: Path) -> None:
    episodes, _ = await _run(chat_model_dir, rewriting_agent, group_size=1)

    assert len(episodes) == 2 and [ep.group_size for ep in episodes] == [2, 2]
    assert all(list(ep.loss_mask) == [1] * len(ep.completion_token_ids) for ep in episodes)
    assert all(ep.reward == 1.0 for ep in episodes)


async def test_session_limits_refuse_with_413_and_a_finished_session_is_404(chat_model_dir: Path) -> None:
    seen: dict[str, Any] = {}

    async def greedy_agent(base_url: str, row: Prompt) -> float:
        client = _client(base_url)
        seen["url"] = base_url
        messages = [{"role": "user", "content": row.prompt}]
        for _ in range(2):
            await client.chat.completions.create(model="any", messages=messages, max_tokens=3)  # type: ignore[arg-type]
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model="any", messages=messages, max_tokens=3)  # type: ignore[arg-type]
        seen["third"] = refused.value.status_code
        with pytest.raises(openai.BadRequestError):  # sampling is the rollout's
            await client.chat.completions.create(model="any", messages=messages, temperature=0.2)  # type: ignore[arg-type]
        return 0.0

    async def after() -> None:
        with pytest.raises(openai.NotFoundError):
            await _client(seen["url"]).chat.completions.create(
                model="any", messages=[{"role": "user", "content": "hi"}]
            )

    episodes, _ = await _run(chat_model_dir, greedy_agent, group_size=1, after=after, max_calls=2)

    assert seen["third"] == 413
    assert len(episodes) == 2  # same prompt twice: neither call extends the other


async def test_agent_that_times_out_or_raises_marks_its_episodes(chat_model_dir: Path) -> None:
    async def stuck_agent(base_url: str, row: Prompt) -> float:
        await _client(base_url).chat.completions.create(
            model="any", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        await asyncio.sleep(60)
        return 1.0

    async def broken_agent(base_url: str, row: Prompt) -> float:
        await _client(base_url).chat.completions.create(
            model="any", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        raise RuntimeError("agent bug")

    timed_out, w1 = await _run(chat_model_dir, stuck_agent, group_size=1, session_timeout_s=2.0)
    failed, w2 = await _run(chat_model_dir, broken_agent, group_size=1)

    assert [ep.reward_status for ep in timed_out] == [reward_pb2.SCORE_STATUS_TIMEOUT]
    assert w1.sessions_timed_out == 1
    assert [ep.reward_status for ep in failed] == [reward_pb2.SCORE_STATUS_ERROR]
    assert "RuntimeError" in failed[0].reward_error and "agent bug" not in failed[0].reward_error
    assert w2.sessions_failed == 1


async def test_agent_without_reward_is_scored_by_the_reward_service_on_its_last_answer(chat_model_dir: Path) -> None:
    last: list[str] = []

    async def silent_agent(base_url: str, row: Prompt) -> None:
        r = await _client(base_url).chat.completions.create(
            model="any", messages=[{"role": "user", "content": row.prompt}], max_tokens=6
        )  # type: ignore[arg-type]
        last.append(r.choices[0].message.content or "")
        return None

    async def go() -> list[episode_pb2.Episode]:
        async with reward_server("tests.reward_fns:length") as (target, _):
            episodes, _ = await _run(
                chat_model_dir, silent_agent, group_size=1, reward_target=target, reward=AgentReward.AUTO
            )
            return episodes

    [ep] = await go()

    assert ep.reward_status == reward_pb2.SCORE_STATUS_OK
    assert ep.reward == float(len(last[0]))  # tests.reward_fns:length scores len(completion)


@pytest.mark.slow  # fitting the tool model takes ~20 s (once per session, shared with test_openai_tools.py)
async def test_agent_calls_a_tool_through_the_session_and_the_model_answers_from_its_result(
    tool_model_dir: Path,
) -> None:
    import json

    from tests.integration.tool_model import ANSWER, QUESTION, TOOLS

    model_dir = tool_model_dir
    replies: list[Any] = []

    async def tool_agent(base_url: str, row: Prompt) -> float:
        client = _client(base_url)
        messages: list[Any] = list(QUESTION)
        first = await client.chat.completions.create(
            model="any",
            messages=messages,
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=80,
        )
        [call] = first.choices[0].message.tool_calls or []
        args = json.loads(call.function.arguments)  # type: ignore[union-attr]
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
        ]
        second = await client.chat.completions.create(
            model="any",
            messages=messages,
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=40,
        )
        replies.extend([first.choices[0], second.choices[0]])
        return float(second.choices[0].message.content == ANSWER)

    async def go() -> list[episode_pb2.Episode]:
        greedy = Sampling(temperature=1.0, top_k=1, generate_timeout_s=30)
        workflow = AgentWorkflow(
            AgentConfig(), load_tokenizer(model_dir), greedy, max_episode_tokens=128, agent=tool_agent
        )
        async with inference_server(model_dir) as (target, _), InferenceClient(target) as inference:
            ctx = WorkflowContext(
                inference=inference, reward=None, group_id="g", group_size=1, producer_id="t", created_at=time.time()
            )
            try:
                return await workflow(Prompt("t", "What is 1+2?", "3"), ctx)
            finally:
                await workflow.close()

    episodes = await go()

    assert replies[0].finish_reason == "tool_calls" and replies[1].message.content == ANSWER
    assert all(ep.reward == 1.0 for ep in episodes)
    # this template writes no end-of-turn token after the call, while the model's turn ended with its EOS: the
    # history re-rendered for the second call differs from the tokens of the first, so each call is its own episode
    assert len(episodes) == 2 and all(set(ep.loss_mask) == {1} for ep in episodes)


async def test_tokens_of_a_session_carry_the_weight_version_that_sampled_them_across_an_update(
    chat_model_dir: Path,
) -> None:
    from relayrl.common.weights import iter_update_messages, model_tensors
    from tests.conftest import WEIGHTS_TOKEN

    tensors = model_tensors(load_model(ModelConfig(path=chat_model_dir)))

    async def go() -> list[episode_pb2.Episode]:
        workflow = AgentWorkflow(
            AgentConfig(), load_tokenizer(chat_model_dir), SAMPLING, max_episode_tokens=64, agent=updating_agent
        )
        async with (
            inference_server(chat_model_dir) as (target, service),
            InferenceClient(target) as inference,
            InferenceClient(service.weights_target, token=WEIGHTS_TOKEN) as weights,
        ):

            async def publish() -> None:  # the trainer publishes version 1 between the agent's two calls
                await weights.update_weights(list(iter_update_messages(tensors, 1)), 1, 30, attempts=1)

            published.append(publish)
            ctx = WorkflowContext(
                inference=inference, reward=None, group_id="g", group_size=1, producer_id="t", created_at=time.time()
            )
            try:
                return await workflow(ROW, ctx)
            finally:
                await workflow.close()

    published: list[Callable[[], Awaitable[None]]] = []

    async def updating_agent(base_url: str, row: Prompt) -> float:
        client = _client(base_url)
        messages: list[Any] = [{"role": "user", "content": row.prompt}]
        r = await client.chat.completions.create(model="any", messages=messages, max_tokens=5, seed=1)
        await published[0]()
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content or ""},
            {"role": "user", "content": "Again"},
        ]
        await client.chat.completions.create(model="any", messages=messages, max_tokens=5, seed=1)
        return 0.0

    [ep] = await go()  # one episode: the second call extends the first (seed 1 samples no special token)

    mask, versions = list(ep.loss_mask), list(ep.token_weight_versions)
    first_turn = mask.index(0)
    second_turn = len(mask) - mask[::-1].index(0)
    assert set(versions[:first_turn]) == {0}  # sampled before the update
    assert set(versions[first_turn:second_turn]) == {0}  # gap tokens: the version of the model turn before them
    assert set(versions[second_turn:]) == {1} and all(m == 1 for m in mask[second_turn:])
