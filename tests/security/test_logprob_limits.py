"""Logprob requests cannot blow the inference service's memory: echo with logprobs of a prompt whose prompt x
vocabulary matrix is over ``inference.max_prompt_logprob_mib``, or a request asking for more logprob values than
``inference.max_logprob_entries`` (over prompts, n and alternatives), is refused at once with an OpenAI-shaped
413 naming the field, before the engine sees it; requests under the limits are served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.helpers import inference_server

pytestmark = [pytest.mark.security, pytest.mark.integration]


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a context long enough for the prompts below (a prompt must fit the model's context,
    prompt + max_tokens checked before the logprob limits)."""
    from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model

    return create_tiny_model(
        tmp_path_factory.mktemp("models") / "long",
        TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, seed=1, max_position_embeddings=20_001),
    )


async def _post(service: Any, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], int]:
    """(status, JSON body, engine decode steps taken meanwhile)."""
    before = service.engine.stats().decode_steps
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}", timeout=60) as http:
        resp = await http.post(route, json=body)
    return resp.status_code, resp.json(), service.engine.stats().decode_steps - before


async def test_echo_of_a_prompt_whose_logprob_matrix_is_over_the_limit_is_413_before_the_engine(
    long_model_dir: Path,
) -> None:
    async def go() -> list[tuple[int, dict[str, Any], int]]:
        # 1 MiB of float32 logprobs over the tiny model's vocabulary (18 tokens) is 14,563 prompt tokens
        async with inference_server(long_model_dir, http=True, max_prompt_logprob_mib=1, max_prompt_tokens=20_000) as (
            _,
            service,
        ):
            vocab = service.engine.vocab_size
            too_long = [5] * (2**20 // (4 * vocab) + 1)
            return [
                await _post(service, "/v1/completions", body)
                for body in (
                    {"prompt": too_long, "max_tokens": 1, "logprobs": 0, "echo": True},
                    {"prompt": [too_long[:100], too_long], "max_tokens": 1, "logprobs": 1, "echo": True},
                    {"prompt": [5] * 100, "max_tokens": 1, "logprobs": 1, "echo": True},
                )
            ]

    (s1, b1, steps1), (s2, b2, steps2), (ok, body, _) = await go()

    for status, err, steps in ((s1, b1, steps1), (s2, b2, steps2)):
        assert status == 413 and steps == 0
        assert err["error"]["param"] == "echo" and err["error"]["code"] == "request_too_large"
        assert "max_prompt_logprob_mib=1" in err["error"]["message"]
    assert ok == 200 and len(body["choices"][0]["logprobs"]["token_logprobs"]) == 101  # 100 echoed + 1 new


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        # 8 samples x 100 tokens x (1 + 20 alternatives) = 16,800 values
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "1+2="}],
                "n": 8,
                "max_completion_tokens": 100,
                "logprobs": True,
                "top_logprobs": 20,
            },
            "top_logprobs",
        ),
        # 3 prompts x 4 samples x (100 echoed + 50 new tokens) x (1 + 5) = 10,800 values
        (
            "/v1/completions",
            {"prompt": [[5] * 100] * 3, "n": 4, "max_tokens": 50, "logprobs": 5, "echo": True},
            "logprobs",
        ),
    ],
)
async def test_request_asking_for_more_logprob_values_than_the_limit_is_413(
    tiny_model_dir: Path, route: str, body: dict[str, Any], param: str
) -> None:
    async def go() -> list[tuple[int, dict[str, Any], int]]:
        async with inference_server(tiny_model_dir, http=True, max_logprob_entries=10_000) as (_, service):
            smaller = {**body, "n": 1}  # the same request with one sample is under the limit
            return [await _post(service, route, body), await _post(service, route, smaller)]

    (status, err, steps), (ok, _, _) = await go()

    assert status == 413 and steps == 0
    assert err["error"]["param"] == param and "max_logprob_entries=10000" in err["error"]["message"]
    assert ok == 200
