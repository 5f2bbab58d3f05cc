"""The OpenAI-compatible API on the vLLM backend: streaming token by token, logprob alternatives, prompt logprobs
(echo) and greedy decoding (``temperature: 0``), each compared with the Hugging Face model or the unstreamed
answer; and a clear 400 for what vLLM cannot do the relayrl way."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from relayrl.common.http import HttpServer
from relayrl.common.model import load_model, load_tokenizer
from relayrl.config.inference import EngineKind, InferenceConfig
from relayrl.config.model import ModelConfig
from relayrl.inference.http_app import create_app
from relayrl.inference.serving import InferenceService

pytestmark = pytest.mark.vllm

ATOL = 1e-5  # vLLM's CPU kernels vs Hugging Face's forward, both float32: rounding only (measured 1e-6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("vllm_openai") / "tiny", TinyModelConfig(seed=3))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Any]:
    from relayrl.inference.vllm_engine import VllmEngine

    eng = VllmEngine(ModelConfig(path=model_dir), InferenceConfig(engine=EngineKind.VLLM, max_batch_sequences=16))
    yield eng
    eng.close()


@asynccontextmanager
async def _api(engine: Any, model_dir: Path) -> AsyncIterator[tuple[openai.AsyncOpenAI, str]]:
    cfg = InferenceConfig(engine=EngineKind.VLLM)
    cfg.http.port = 0
    service = InferenceService(cfg, engine, load_tokenizer(model_dir), str(model_dir))
    rest = HttpServer(create_app(service), cfg.http, "inference")
    await rest.start()
    try:
        yield (
            openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{rest.port}/v1", api_key="unused", timeout=120, max_retries=0
            ),
            service.model_name,
        )
    finally:
        await rest.stop()


def _hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """log_softmax at every position of ``ids`` under the Hugging Face model: [len - 1, vocab], scoring ids[1:]."""
    model = load_model(ModelConfig(path=model_dir))
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


async def test_streamed_completion_arrives_token_by_token_and_joins_to_the_whole(engine: Any, model_dir: Path) -> None:
    async def go() -> tuple[Any, list[Any]]:
        async with _api(engine, model_dir) as (client, model):
            args = {
                "model": model,
                "prompt": "1+2=",
                "max_tokens": 10,
                "temperature": 0,
                "logprobs": 2,
                "extra_body": {"ignore_eos": True},
            }
            whole = await client.completions.create(**args)
            stream = await client.completions.create(stream=True, **args)
            return whole, [c async for c in stream]

    whole, chunks = await go()

    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 5  # pieces as tokens are sampled, not the answer in one chunk
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    streamed = [lp for c in text_chunks for lp in (c.choices[0].logprobs.token_logprobs or [])]
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=ATOL)
    assert text_chunks[-1].choices[0].finish_reason == "length"


async def test_alternatives_and_echoed_prompt_logprobs_equal_hugging_face(engine: Any, model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    prompt = tok("12+34=", add_special_tokens=False)["input_ids"]

    async def go() -> Any:
        async with _api(engine, model_dir) as (client, model):
            return await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=4,
                temperature=0,
                logprobs=3,
                echo=True,
                extra_body={"ignore_eos": True},
            )

    lp = (await go()).choices[0].logprobs
    ids = prompt + [tok(t, add_special_tokens=False)["input_ids"][0] for t in lp.tokens[len(prompt) :]]
    ref = _hf_logprobs(model_dir, ids)

    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(prompt) + 4
    actual = torch.tensor(lp.token_logprobs[1:], dtype=torch.float32)
    expected = ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(actual, expected, rtol=0, atol=ATOL)  # prompt and generated tokens alike
    for pos, top in enumerate(lp.top_logprobs[1:]):
        values, top_ids = ref[pos].topk(3)
        want = {tok.decode([i]): v for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)}
        assert set(want) <= set(top)  # the 3 likeliest (plus the scored token when it is not among them)
        assert all(abs(top[k] - v) <= ATOL for k, v in want.items())
    for pos in range(len(prompt) - 1, len(ids) - 1):  # greedy: every generated token is the argmax
        assert ids[pos + 1] == int(ref[pos].argmax())


async def test_echo_at_a_temperature_vllm_does_not_temper_is_a_400_naming_it(engine: Any, model_dir: Path) -> None:
    async def go() -> httpx.Response:
        async with (
            _api(engine, model_dir) as (client, model),
            httpx.AsyncClient(base_url=str(client.base_url), timeout=60) as http,
        ):
            return await http.post(
                "completions",
                json={
                    "model": model,
                    "prompt": "1+2=",
                    "max_tokens": 1,
                    "temperature": 0.7,
                    "logprobs": 1,
                    "echo": True,
                },
            )

    resp = await go()
    assert resp.status_code == 400
    assert "temperature 1" in resp.json()["error"]["message"] and "echo" in resp.json()["error"]["message"]
