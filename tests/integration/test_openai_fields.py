"""Which OpenAI fields the REST API honours, and how it refuses those it does not: always a 400 in OpenAI's error
shape that names the field, never a silent drop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.helpers import inference_server

pytestmark = pytest.mark.integration


def _client(service: object) -> openai.AsyncOpenAI:
    port = service.http_port  # type: ignore[attr-defined]
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30, max_retries=0)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # no tool-capable template
        ({"messages": [{"role": "tool", "content": "3", "tool_call_id": "c"}]}, "messages"),
    ],
)
async def test_unsupported_chat_field_is_a_400_naming_it(
    tiny_model_dir: Path, kwargs: dict[str, object], param: str
) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            args: dict[str, object] = {
                "model": service.model_name,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "1"}],
                **kwargs,
            }
            with pytest.raises(openai.BadRequestError) as info:
                await _client(service).chat.completions.create(**args)  # type: ignore[call-overload]

            body = info.value.body
            assert isinstance(body, dict) and body["type"] == "invalid_request_error"
            assert body["param"] is not None and body["param"].startswith(param.split(".")[0])
            assert param.split(".")[0] in body["message"]

    await go()


async def test_errors_have_openai_shape_for_an_unknown_model(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}") as http:  # type: ignore[attr-defined]
                resp = await http.post("/v1/completions", json={"model": "gpt-9", "prompt": "1"})

            assert resp.status_code == 404
            assert resp.json() == {
                "error": {
                    "message": resp.json()["error"]["message"],
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            }

    await go()


async def test_seed_n_stop_list_and_max_completion_tokens_are_honoured(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            client = _client(service)
            msgs = [{"role": "user", "content": "7*8="}]
            a, b, c = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=service.model_name,
                        messages=msgs,
                        n=3,
                        seed=seed,
                        max_completion_tokens=6,
                        temperature=1.5,
                        extra_body={"ignore_eos": True},
                    )
                    for seed in (11, 11, 12)
                )
            )  # type: ignore[call-overload]
            stopped = await client.completions.create(
                model=service.model_name,
                prompt="1",
                max_tokens=30,
                temperature=0,
                stop=["1", "2", "3", "4"],
                logprobs=0,
                extra_body={"ignore_eos": True},
            )

            texts = [[ch.message.content for ch in r.choices] for r in (a, b, c)]
            assert texts[0] == texts[1] and texts[0] != texts[2]  # the seed decides the samples
            assert len(texts[0]) == 3 and a.usage is not None and a.usage.completion_tokens == 18  # 3 x 6 tokens
            [s] = stopped.choices
            assert not any(x in s.text for x in "1234")  # the text ends before the first stop string, without it
            assert s.logprobs is not None and s.logprobs.tokens is not None
            if s.finish_reason == "stop":  # the stop string's token still counts: last in logprobs (and usage)
                assert s.logprobs.tokens[-1] in "1234" and "".join(s.logprobs.tokens) == s.text + s.logprobs.tokens[-1]
            else:
                assert len(s.text) == 30

    await go()
