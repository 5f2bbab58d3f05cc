"""Server-sent-event streaming of the OpenAI-compatible API, driven by the official openai client (and httpx for
a client that goes away mid-stream)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.helpers import inference_server

pytestmark = pytest.mark.integration


def _client(service: object) -> openai.AsyncOpenAI:
    port = service.http_port  # type: ignore[attr-defined]
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30, max_retries=0)


async def test_streamed_completion_joins_to_the_unstreamed_text_and_ends_with_finish_reason_and_usage(
    tiny_model_dir: Path,
) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            client = _client(service)
            args = {
                "model": service.model_name,
                "prompt": "1+2=",
                "max_tokens": 12,
                "temperature": 0,
                "extra_body": {"ignore_eos": True},
            }
            whole = await client.completions.create(**args)  # type: ignore[call-overload]
            stream = await client.completions.create(
                stream=True, stream_options={"include_usage": True}, logprobs=2, **args
            )  # type: ignore[call-overload]
            chunks = [c async for c in stream]

            text_chunks = [c for c in chunks if c.choices]
            assert len(text_chunks) >= 2  # deltas as tokens come, not one blob
            assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
            assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
            assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
            streamed_lps = [lp for c in text_chunks for lp in (c.choices[0].logprobs.token_logprobs or [])]
            assert len(streamed_lps) == 12
            versions = [v for c in text_chunks for v in c.choices[0].model_extra["weight_versions"]]
            assert versions == [0] * 12
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == 4
            assert chunks[-1].model_extra is not None and chunks[-1].model_extra["weight_version"] == 0

    await go()


async def test_streamed_chat_with_n_and_stop_list_gives_each_choice_its_role_deltas_and_finish(
    tiny_model_dir: Path,
) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            client = _client(service)
            args = {
                "model": service.model_name,
                "messages": [{"role": "user", "content": "2+2="}],
                "n": 2,
                "max_completion_tokens": 10,
                "temperature": 0,
                "stop": ["=", "+"],
            }
            whole = await client.chat.completions.create(**args)  # type: ignore[call-overload]
            stream = await client.chat.completions.create(stream=True, **args)  # type: ignore[call-overload]
            chunks = [c async for c in stream]

            for index in (0, 1):
                mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
                assert mine[0].delta.role == "assistant"
                assert "".join(ch.delta.content or "" for ch in mine) == whole.choices[index].message.content
                assert mine[-1].finish_reason == whole.choices[index].finish_reason
            assert whole.choices[0].message.content == whole.choices[1].message.content  # greedy: alike

    await go()


async def test_client_that_goes_away_mid_stream_frees_its_engine_row_before_the_request_would_end(
    tiny_model_dir: Path,
) -> None:
    max_tokens = 200

    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            engine = service.engine
            gate = threading.Event()  # the engine holds before its 4th forward pass until the client is gone

            def hold(*_: object) -> None:
                if engine.decode_steps >= 3:
                    assert gate.wait(30)

            hook = engine.model.register_forward_pre_hook(hold)  # type: ignore[attr-defined]
            base = f"http://127.0.0.1:{service.http_port}"  # type: ignore[attr-defined]
            body = {"prompt": "1+", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            async with (
                httpx.AsyncClient(base_url=base, timeout=30) as http,
                http.stream("POST", "/v1/completions", json=body) as resp,
            ):
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        first = json.loads(line[6:])
                        break

            # the connection is closed: wait (bounded) until the server has cancelled the request, then let the
            # engine go on; it must drop the row at its next step instead of generating the other ~197 tokens
            def cancelled() -> bool:  # held with the cancelled row, or (disconnect seen sooner) already dropped it
                rows = engine._rows  # type: ignore[attr-defined]
                return engine.stats().cancelled_sequences == 1 or bool(rows and rows[0].req.future.cancelled())

            for _ in range(2000):
                if cancelled():
                    break
                await asyncio.sleep(0.005)
            assert cancelled(), engine.stats()
            gate.set()
            for _ in range(2000):
                if engine.stats().cancelled_sequences == 1 and engine.stats().running_sequences == 0:
                    break
                await asyncio.sleep(0.005)
            hook.remove()
            stats = engine.stats()

            versions = first["choices"][0]["weight_versions"]  # the tokens behind its text (a special one has none)
            assert versions and set(versions) == {0}
            assert stats.cancelled_sequences == 1 and stats.running_sequences == 0
            assert stats.decode_steps <= 5  # held at step 4; dropped before step 5 could start
            assert service.requests_served == 0  # it was dropped, not finished
            async with httpx.AsyncClient(base_url=base, timeout=10) as http:
                metrics = (await http.get("/metrics")).text
            assert "relayrl_inference_cancelled_sequences_total 1.0" in metrics
            ok = await _client(service).completions.create(model=service.model_name, prompt="1", max_tokens=2)
            assert len(ok.choices) == 1

    await go()


async def test_stop_string_is_never_sent_streamed_or_not_and_streamed_text_joins_to_the_whole(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from tests.integration.eval_model import create_eval_model

    model_dir = create_eval_model(tmp_path_factory.mktemp("models") / "evalmodel")  # varied greedy answers

    async def go() -> None:
        async with inference_server(model_dir, http=True) as (_, service):
            client = _client(service)
            args = {
                "model": service.model_name,
                "prompt": "75+3=",
                "max_tokens": 16,
                "temperature": 0,
                "extra_body": {"ignore_eos": True},
            }
            free = (await client.completions.create(**args)).choices[0].text  # type: ignore[call-overload]
            # a 3-character stop string that first occurs after a few characters of the free answer
            at = next(k for k in range(2, len(free) - 3) if free.find(free[k : k + 3]) == k)
            stop = free[at : at + 3]
            whole = await client.completions.create(stop=stop, **args)  # type: ignore[call-overload]
            stream = await client.completions.create(stop=stop, stream=True, **args)  # type: ignore[call-overload]
            pieces = [c.choices[0].text for c in [c async for c in stream] if c.choices]

            assert whole.choices[0].text == free[:at] and whole.choices[0].finish_reason == "stop"
            assert "".join(pieces) == free[:at]  # no piece of the stop string was ever sent
            assert whole.usage is not None and whole.usage.completion_tokens == at + 3  # its tokens still count

    await go()
