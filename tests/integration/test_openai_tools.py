"""Tool calls on the chat API: tools rendered by the model's chat template, the model's ``<tool_call>`` output
parsed into ``tool_calls`` (finish_reason "tool_calls"), the tool's result sent back as a ``tool`` message, with
the official openai client, streamed and not. The model (tests/integration/tool_model.py) was fitted to really
make that call, so these are real generations, not canned text."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.integration.helpers import inference_server
from tests.integration.tool_model import ANSWER, CALLED, QUESTION, TOOLS

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # fitting the model takes ~20 s on a quiet machine


def _client(service: object) -> openai.AsyncOpenAI:
    port = service.http_port  # type: ignore[attr-defined]
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30, max_retries=0)


async def test_tool_call_round_trip_parses_the_call_and_answers_from_the_tool_message(tool_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tool_model_dir, http=True) as (_, service):
            client = _client(service)
            first = await client.chat.completions.create(
                model=service.model_name,
                messages=QUESTION,  # type: ignore[arg-type]
                tools=TOOLS,
                temperature=0,
                max_tokens=80,
            )  # type: ignore[arg-type]
            [choice] = first.choices
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            [call] = choice.message.tool_calls or []
            assert call.type == "function" and call.id.startswith("call_")
            assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}

            # the client sends the call back as the assistant's turn, then the tool's result
            history = [
                *QUESTION,
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "3"},
            ]
            second = await client.chat.completions.create(
                model=service.model_name,
                messages=history,  # type: ignore[arg-type]
                tools=TOOLS,
                temperature=0,
                max_tokens=40,
            )  # type: ignore[arg-type]
            assert second.choices[0].finish_reason == "stop"
            assert second.choices[0].message.content == ANSWER
            assert second.choices[0].message.tool_calls is None

    await go()


async def test_streamed_tool_call_arrives_as_a_tool_calls_delta(tool_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tool_model_dir, http=True) as (_, service):
            stream = await _client(service).chat.completions.create(
                model=service.model_name,
                messages=QUESTION,
                tools=TOOLS,
                temperature=0,
                max_tokens=80,  # type: ignore[arg-type]
                stream=True,
            )
            chunks = [c async for c in stream]

            deltas = [c.choices[0] for c in chunks if c.choices]
            calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
            assert [(tc.index, tc.function.name) for tc in calls] == [(0, "add")]  # type: ignore[union-attr]
            assert json.loads(calls[0].function.arguments or "") == {"a": 1, "b": 2}  # type: ignore[union-attr]
            assert deltas[-1].finish_reason == "tool_calls"

    await go()


async def test_tool_choice_none_leaves_tools_out_of_the_prompt(tool_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tool_model_dir, http=True) as (_, service):
            resp = await _client(service).chat.completions.create(
                model=service.model_name,
                messages=QUESTION,
                tools=TOOLS,
                tool_choice="none",
                temperature=0,  # type: ignore[arg-type]
                max_tokens=5,
            )

            assert resp.choices[0].message.tool_calls is None
            assert resp.usage is not None and resp.usage.prompt_tokens == len("user: What is 1+2?\nassistant: ")

    await go()


async def test_history_replays_through_the_template_like_the_model_was_fitted(tool_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tool_model_dir, http=True) as (_, service):
            resp = await _client(service).chat.completions.create(
                model=service.model_name, messages=CALLED, tools=TOOLS, temperature=0, max_tokens=40
            )  # type: ignore[arg-type]
            assert resp.choices[0].message.content == ANSWER

    await go()


async def test_langchain_openai_calls_the_tool_and_streams_the_answer(tool_model_dir: Path) -> None:
    """A higher-level client agent builders use: langchain-openai's ChatOpenAI with bound tools, then streaming."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async def go() -> None:
        async with inference_server(tool_model_dir, http=True) as (_, service):
            llm = ChatOpenAI(
                base_url=f"http://127.0.0.1:{service.http_port}/v1",
                api_key="unused",  # type: ignore[attr-defined,arg-type]
                model=service.model_name,
                temperature=0,
                max_tokens=80,
                max_retries=0,
                timeout=30,
            )
            question = [HumanMessage(QUESTION[0]["content"])]
            asked = await llm.bind_tools([add]).ainvoke(question)
            [call] = asked.tool_calls  # type: ignore[attr-defined]
            assert call["name"] == "add" and call["args"] == {"a": 1, "b": 2}

            result = await add.ainvoke(call["args"])
            answer = await llm.bind_tools([add]).ainvoke(
                [*question, asked, ToolMessage(str(result), tool_call_id=call["id"])]
            )
            assert answer.content == ANSWER

            chunks = [c async for c in llm.astream("What is 1+2?")]
            assert len(chunks) > 2  # streamed in pieces
            whole = await llm.ainvoke("What is 1+2?")
            assert "".join(str(c.content) for c in chunks) == whole.content

    await go()


async def test_openai_agents_sdk_runs_a_tool_calling_turn_to_its_final_answer(tool_model_dir: Path) -> None:
    """The openai-agents SDK (chat-completions model): the agent calls the tool, runs it, and answers."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # nothing is sent anywhere
    ran: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    async def go() -> str:
        async with inference_server(tool_model_dir, http=True) as (_, service):
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{service.http_port}/v1",
                api_key="unused",  # type: ignore[attr-defined]
                max_retries=0,
                timeout=30,
            )
            # greedy: the SDK leaves the temperature to the server (1: sampling), which made the answer depend on
            # the engine's random state, i.e. on the tests that ran before in the same process
            agent = Agent(
                name="calc",
                tools=[add],
                model_settings=ModelSettings(temperature=0),
                model=OpenAIChatCompletionsModel(model=service.model_name, openai_client=client),
            )
            result = await Runner.run(agent, QUESTION[0]["content"], max_turns=3)
            return str(result.final_output)

    assert await go() == ANSWER
    assert ran == [(1, 2)]
