"""Inference remembers the token ids of prompt texts it has tokenised (RL sends the same prompts again and again)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.common.model import load_model, load_tokenizer
from relayrl.config.inference import InferenceConfig
from relayrl.config.model import ModelConfig
from relayrl.inference import serving
from relayrl.inference.native import NativeEngine
from relayrl.inference.serving import InferenceService


class CountingTokenizer:
    """The real tokenizer, counting its calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(text, **kwargs)


@pytest.fixture
def service(tiny_model_dir: Path) -> tuple[InferenceService, CountingTokenizer]:
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = NativeEngine(load_model(ModelConfig(path=tiny_model_dir)), tokenizer, torch.device("cpu"))
    counting = CountingTokenizer(tokenizer)
    return InferenceService(InferenceConfig(), engine, counting, str(tiny_model_dir)), counting


async def test_a_repeated_prompt_gets_the_same_ids_without_tokenising_again(
    service: tuple[InferenceService, CountingTokenizer],
) -> None:
    svc, counting = service

    first = await svc.tokenize_cached("3+4=")
    again = await svc.tokenize_cached("3+4=")
    other = await svc.tokenize_cached("5+1=")

    assert first == again == list(counting.inner("3+4=", add_special_tokens=False)["input_ids"])
    assert other != first
    assert counting.calls == 2  # two distinct texts (the reference above called the tokenizer itself)
    again.append(0)  # a caller's list is its own: the remembered ids do not change
    assert await svc.tokenize_cached("3+4=") == first


async def test_the_cache_keeps_at_most_its_size_dropping_the_oldest_first(
    service: tuple[InferenceService, CountingTokenizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, counting = service
    monkeypatch.setattr(serving, "TOKEN_CACHE_SIZE", 2)

    for text in ("1+1=", "2+2=", "3+3="):
        await svc.tokenize_cached(text)
    await svc.tokenize_cached("2+2=")  # still remembered
    await svc.tokenize_cached("1+1=")  # dropped when 3+3= came: tokenised again

    assert counting.calls == 4


async def test_empty_and_too_long_prompts_are_still_refused(
    service: tuple[InferenceService, CountingTokenizer],
) -> None:
    svc, _ = service

    with pytest.raises(ValueError, match="empty"):
        await svc.tokenize_cached("")
    too_long = "1" * (svc.cfg.max_prompt_chars + 1)
    with pytest.raises(ValueError, match="max_prompt_chars"):
        await svc.tokenize_cached(too_long)
    with pytest.raises(ValueError, match="max_prompt_chars"):  # refused again: a refusal is never remembered
        await svc.tokenize_cached(too_long)
