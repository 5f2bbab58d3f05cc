"""Logprob alternatives and prompt logprobs on the OpenAI API, checked against the Hugging Face model run directly
(the same tempered full softmax: log_softmax(logits / temperature) before any top-k/top-p truncation)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
import torch

from relayrl.common.model import load_model, load_tokenizer
from relayrl.config.model import ModelConfig
from tests.integration.helpers import inference_server

pytestmark = pytest.mark.integration

# The engine decodes with a KV cache in a batch; the reference is one full forward pass, both float32 on CPU:
# they differ by float rounding only (~1e-6), far below any real difference between two tokens' logprobs.
ATOL = 1e-4


def _client(service: object) -> openai.AsyncOpenAI:
    port = service.http_port  # type: ignore[attr-defined]
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30, max_retries=0)


def _reference(model_dir: Path, ids: list[int], temperature: float) -> torch.Tensor:
    """[len(ids) - 1, V]: the log-distribution that scores ids[1:], from one HF forward pass."""
    model = load_model(ModelConfig(path=model_dir))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


async def test_completion_logprobs_n_gives_the_n_likeliest_tokens_of_the_tempered_softmax(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            resp = await _client(service).completions.create(
                model=service.model_name,
                prompt="1+2=",
                max_tokens=6,
                temperature=0.7,
                logprobs=3,
                seed=7,
                extra_body={"ignore_eos": True},
            )
            return resp

    resp = await go()
    tok = load_tokenizer(tiny_model_dir)
    [choice] = resp.choices
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    prompt = tok("1+2=", add_special_tokens=False)["input_ids"]
    generated = tok("".join(lp.tokens), add_special_tokens=False)["input_ids"]
    ref = _reference(tiny_model_dir, prompt + generated, 0.7)[len(prompt) - 1 :]
    for t, (token, sampled_lp, top) in enumerate(zip(generated, lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert sampled_lp == pytest.approx(float(ref[t, token]), abs=ATOL)
        values, ids = ref[t].topk(3)
        expected = {tok.decode([int(i)]): float(v) for v, i in zip(values, ids, strict=True)}
        expected.setdefault(tok.decode([token]), float(ref[t, token]))  # the sampled token is always listed
        assert top.keys() == expected.keys()
        for key, value in expected.items():
            assert top[key] == pytest.approx(value, abs=ATOL)


async def test_echo_with_logprobs_scores_the_prompt_first_token_null(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            return await _client(service).completions.create(
                model=service.model_name, prompt=["12+34=", "5*6="], max_tokens=1, temperature=0, logprobs=2, echo=True
            )

    resp = await go()
    tok = load_tokenizer(tiny_model_dir)
    for choice, prompt_text in zip(resp.choices, ["12+34=", "5*6="], strict=True):  # two prompts, padded together
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert choice.text.startswith(prompt_text)
        prompt = tok(prompt_text, add_special_tokens=False)["input_ids"]
        ref = _reference(tiny_model_dir, prompt, 1.0)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for p in range(1, len(prompt)):
            assert lp.token_logprobs[p] == pytest.approx(float(ref[p - 1, prompt[p]]), abs=ATOL)
            assert max(lp.top_logprobs[p].values()) == pytest.approx(float(ref[p - 1].max()), abs=ATOL)
        assert len(lp.token_logprobs) == len(prompt) + 1
        assert lp.text_offset == list(range(len(prompt) + 1))  # one character per token


async def test_chat_top_logprobs_lists_alternatives_most_likely_first(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir, http=True) as (_, service):
            client = _client(service)
            both = await asyncio.gather(
                client.chat.completions.create(
                    model=service.model_name,
                    max_tokens=5,
                    temperature=0,
                    messages=[{"role": "user", "content": "3+4="}],
                    logprobs=True,
                    top_logprobs=4,
                ),
                client.completions.create(model=service.model_name, prompt="9", max_tokens=5),
            )  # batched with it
            return both[0]

    resp = await go()
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content
    for entry in content:
        alternatives = [a.logprob for a in entry.top_logprobs]
        assert len(alternatives) == 4 and alternatives == sorted(alternatives, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the likeliest
        assert entry.logprob == pytest.approx(alternatives[0], abs=1e-6)  # same tensor, no recomputation
