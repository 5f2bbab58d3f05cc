"""The agent session endpoint streams a call token by token (inference's GenerateStream forwarded as server-sent
events) and records it exactly when it finishes; a client that goes away mid-stream leaves the session as it was."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from relayrl.client import InferenceClient
from relayrl.common.dataset import Prompt
from relayrl.common.model import load_tokenizer
from relayrl.common.pb import episode_pb2
from relayrl.config.agents import AgentConfig
from relayrl.rollout.workflows.agent import AgentWorkflow
from relayrl.rollout.workflows.agent_proxy import Sampling
from relayrl.rollout.workflows.api import WorkflowContext
from tests.integration.helpers import held_engine, inference_server
from tests.polling import until

pytestmark = pytest.mark.integration
ROW = Prompt("p1", "What is 17 + 25?", "42")
GREEDY = Sampling(temperature=1.0, top_k=1, generate_timeout_s=30)  # a streamed and a plain call sample alike
MESSAGES = [{"role": "user", "content": ROW.prompt}]


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=30, max_retries=0)


async def _session(
    model_dir: Path, agent: Callable[[str, Any, AgentWorkflow], Awaitable[float]]
) -> tuple[list[episode_pb2.Episode], AgentWorkflow]:
    """One session of ``agent(base_url, inference service, workflow)`` through AgentWorkflow's proxy."""
    async with inference_server(model_dir) as (target, service), InferenceClient(target) as inference:
        workflow = AgentWorkflow(
            AgentConfig(),
            load_tokenizer(model_dir),
            GREEDY,
            max_episode_tokens=96,
            agent=lambda url, row: agent(url, service, workflow),
        )  # type: ignore[arg-type]
        ctx = WorkflowContext(
            inference=inference, reward=None, group_id="g1", group_size=1, producer_id="test", created_at=time.time()
        )
        try:
            return await workflow(ROW, ctx), workflow
        finally:
            await workflow.close()


async def test_session_streams_chunks_while_inference_samples_and_records_what_it_sent(chat_model_dir: Path) -> None:
    seen: dict[str, Any] = {}

    async def agent(base_url: str, service: Any, workflow: AgentWorkflow) -> float:
        client = _client(base_url)
        got: dict[str, Any] = {"text": "", "logprobs": [], "versions": [], "chunks": 0}
        async with held_engine(service) as gate:
            stream = await client.chat.completions.create(
                model="any",
                messages=MESSAGES,
                max_tokens=24,
                logprobs=True,
                stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content and "running" not in seen:
                        # the engine holds before its 4th step: the 24-token call is still sampling (its row
                        # shows once admitted; it cannot finish while held), and nothing is recorded yet
                        seen["running"] = await until(lambda: service.engine.stats().running_requests == 1)
                        seen["recorded"] = workflow.proxy.calls_served
                        gate.set()
                    got["chunks"] += bool(choice.delta.content)
                    got["text"] += choice.delta.content or ""
                    got["logprobs"] += [t.logprob for t in (choice.logprobs.content or [])] if choice.logprobs else []
                    got["versions"] += (choice.model_extra or {}).get("weight_versions", [])
                    got["finish"] = choice.finish_reason or got.get("finish")
                got["usage"] = chunk.usage or got.get("usage")
        seen["streamed"] = got
        seen["plain"] = await client.chat.completions.create(
            model="any",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=24,
            logprobs=True,
        )
        return 1.0

    episodes, workflow = await _session(chat_model_dir, agent)

    got, plain = seen["streamed"], seen["plain"]
    assert seen["running"] and seen["recorded"] == 0
    assert got["chunks"] >= 2  # token by token, not one blob
    assert workflow.proxy.calls_served == 2 and len(episodes) == 2  # the same prompt twice: two chains
    streamed_ep = episodes[0]
    assert got["text"] == plain.choices[0].message.content  # greedy: the streamed answer is the plain one
    assert got["finish"] == plain.choices[0].finish_reason
    assert got["usage"].completion_tokens == len(streamed_ep.completion_token_ids) == len(got["logprobs"]) >= 4
    # float32 from inference through JSON: the floats the stream sent are the ones recorded
    assert got["logprobs"] == pytest.approx(list(streamed_ep.behaviour_logprobs), abs=1e-6)
    assert got["versions"] == list(streamed_ep.token_weight_versions) == [0] * len(got["logprobs"])
    assert list(streamed_ep.completion_token_ids) == list(episodes[1].completion_token_ids)


async def test_client_gone_mid_stream_cancels_the_call_and_records_nothing_of_it(chat_model_dir: Path) -> None:
    seen: dict[str, Any] = {}

    async def agent(base_url: str, service: Any, workflow: AgentWorkflow) -> float:
        engine = service.engine
        [entry] = workflow.proxy.sessions.values()
        body = {"model": "any", "messages": MESSAGES, "max_tokens": 24, "stream": True}
        async with held_engine(service) as gate:
            async with (
                httpx.AsyncClient(timeout=30) as http,
                http.stream("POST", f"{base_url}/chat/completions", json=body) as resp,
            ):
                seen["status"] = resp.status_code
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        break  # the first token's text: then the client goes away

            def cancelled() -> bool:  # held with the cancelled row, or (disconnect seen sooner) already dropped it
                rows = engine._rows
                return engine.stats().cancelled_sequences == 1 or bool(rows and rows[0].req.future.cancelled())

            seen["cancelled"] = await until(cancelled)
            gate.set()
        seen["released"] = await until(lambda: entry.session.reserved == 0)
        seen["after"] = (workflow.proxy.calls_served, len(entry.session.calls), entry.session.started)
        plain = await _client(base_url).chat.completions.create(
            model="any",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
        )
        seen["plain"] = plain.choices[0].message.content
        return 1.0

    episodes, workflow = await _session(chat_model_dir, agent)

    assert seen["status"] == 200 and seen["cancelled"] and seen["released"]
    assert seen["after"] == (0, 0, 1)  # nothing recorded; the call counts against max_calls
    assert workflow.proxy.calls_served == 1 and len(episodes) == 1  # the next call is the session's one episode
    assert list(episodes[0].loss_mask) == [1] * len(episodes[0].completion_token_ids)
