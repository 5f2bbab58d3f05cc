"""The OpenAI-compatible REST API of the inference service, driven by the official openai client."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.helpers import inference_server

pytestmark = pytest.mark.integration


def _client(service: object) -> openai.AsyncOpenAI:
    port = service.http_port  # type: ignore[attr-defined]
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30, max_retries=0)


async def test_models_lists_the_served_model(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            models = await _client(service).models.list()

            assert [m.id for m in models.data] == [service.model_name]

    await go()


async def test_completion_returns_n_choices_with_token_logprobs_and_weight_versions(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            resp = await _client(service).completions.create(
                model=service.model_name, prompt="1+2=", max_tokens=4, n=3, temperature=0.7, logprobs=0
            )

            assert len(resp.choices) == 3
            for c in resp.choices:
                assert c.logprobs is not None and c.logprobs.token_logprobs is not None
                n = len(c.logprobs.token_logprobs)
                assert 1 <= n <= 4 and all(lp <= 0 for lp in c.logprobs.token_logprobs)
                assert c.model_extra is not None and c.model_extra["weight_versions"] == [0] * n
                assert c.finish_reason in ("stop", "length")
            assert resp.model_extra is not None and resp.model_extra["weight_version"] == 0
            assert resp.usage is not None and resp.usage.prompt_tokens == 4

    await go()


async def test_chat_completion_returns_the_assistant_message_with_logprobs(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            resp = await _client(service).chat.completions.create(
                model=service.model_name,
                messages=[{"role": "user", "content": "2+2="}],
                max_tokens=3,
                logprobs=True,
                temperature=0,
            )

            [choice] = resp.choices
            assert choice.message.role == "assistant"
            assert choice.logprobs is not None and choice.logprobs.content is not None
            assert 1 <= len(choice.logprobs.content) <= 3
            assert resp.model_extra is not None and resp.model_extra["weight_version"] == 0

    await go()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 100_000}, "max_new_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"echo": True, "stream": True}, "echo"),
        ({"prompt": "1" * 300}, "context"),
    ],
)
async def test_bad_completion_request_is_a_400_and_the_server_keeps_serving(
    tiny_model_dir: Path, kwargs: dict[str, object], param: str
) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            client = _client(service)
            args: dict[str, object] = {"model": service.model_name, "prompt": "1+2=", "max_tokens": 2, **kwargs}

            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(**args)  # type: ignore[call-overload]

            assert param in str(info.value)
            ok = await client.completions.create(model=service.model_name, prompt="1+2=", max_tokens=2)
            assert len(ok.choices) == 1

    await go()


async def test_healthz_and_metrics_report_the_served_version_and_counters(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            await _client(service).completions.create(model=service.model_name, prompt="1+2=", max_tokens=3)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}", timeout=10) as http:  # type: ignore[attr-defined]
                health = (await http.get("/healthz")).json()
                metrics = (await http.get("/metrics")).text

            assert health == {"status": "ok", "weight_version": 0}
            assert 'relayrl_inference_requests_total{api="openai"} 1.0' in metrics
            assert "relayrl_inference_weight_version 0.0" in metrics
            assert "relayrl_inference_generated_tokens_total" in metrics

    await go()
