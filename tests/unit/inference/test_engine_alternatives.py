"""Logprob alternatives and per-token streaming in the native engine, for a request that joins a running batch
whose rows asked for none (the batch's alternatives tensor grows on concat)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from relayrl.common.model import load_model, load_tokenizer
from relayrl.config.model import ModelConfig
from relayrl.inference.engine import GenerationInput, TokenEvent
from relayrl.inference.native import NativeEngine


def test_joining_request_gets_its_alternatives_and_streams_exactly_its_final_tokens(tiny_model_dir: Path) -> None:
    model = load_model(ModelConfig(path=tiny_model_dir))
    engine = NativeEngine(model, load_tokenizer(tiny_model_dir), torch.device("cpu"))
    started = threading.Event()
    events: list[TokenEvent] = []
    try:
        plain = engine.submit(
            GenerationInput(prompt_ids=[3, 4, 5], max_new_tokens=40, ignore_eos=True, on_token=lambda _: started.set())
        )
        assert started.wait(30)  # the plain request is decoding: the next one joins by concat
        asked = engine.submit(
            GenerationInput(
                prompt_ids=[6, 7],
                max_new_tokens=8,
                ignore_eos=True,
                temperature=0.8,
                top_logprobs=3,
                on_token=events.append,
            )
        )
        [a], [b] = plain.result(60), asked.result(60)
    finally:
        engine.close()

    assert a.top_logprobs == []  # asked for none, got none
    assert len(b.top_logprobs) == len(b.token_ids) == 8
    with torch.inference_mode():  # the reference: one full forward pass of the same model, tempered the same way
        logits = model(input_ids=torch.tensor([[6, 7, *b.token_ids]])).logits[0, 1:-1].float()
    ref = torch.log_softmax(logits / 0.8, dim=-1)
    for t, alternatives in enumerate(b.top_logprobs):
        values, ids = ref[t].topk(3)
        assert [i for i, _ in alternatives] == ids.tolist()
        # KV-cache decode in a batch vs one forward pass: float32 rounding only
        torch.testing.assert_close(torch.tensor([lp for _, lp in alternatives]), values, rtol=0, atol=1e-4)
    assert [e.token_id for e in events] == b.token_ids
    assert [e.logprob for e in events] == b.logprobs and [e.top for e in events] == b.top_logprobs
    assert [e.version for e in events] == b.weight_versions


def _recording_engine(model_dir: Path, **kwargs: int) -> tuple[Any, NativeEngine, list[list[bool]]]:
    model = load_model(ModelConfig(path=model_dir))
    engine = NativeEngine(model, load_tokenizer(model_dir), torch.device("cpu"), **kwargs)
    prefills: list[list[bool]] = []  # per prefill step: which of its requests score their prompt
    inner = engine._prefill

    def recording(reqs):  # type: ignore[no-untyped-def]
        prefills.append([r.inp.prompt_logprobs is not None for r in reqs])
        return inner(reqs)

    engine._prefill = recording  # type: ignore[method-assign]
    return model, engine, prefills


def _lone_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():  # the reference: one forward pass of the prompt alone
        ref = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    return ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def test_prompt_scoring_requests_prefill_together_apart_from_plain_ones_with_the_logprobs_of_lone_prefills(
    tiny_model_dir: Path,
) -> None:
    model, engine, prefills = _recording_engine(tiny_model_dir)
    try:
        # a seeded request runs alone: the four after it wait in the queue and are admitted when it ends
        first = engine.submit(GenerationInput(prompt_ids=[3, 4], max_new_tokens=30, ignore_eos=True, seed=1))
        rest = [
            engine.submit(GenerationInput(prompt_ids=ids, max_new_tokens=2, prompt_logprobs=lp))
            for ids, lp in (([5, 6, 7], None), ([8, 9, 10, 11], 2), ([4, 4, 5], 0), ([6, 5], None))
        ]
        first.result(60)
        outs = [f.result(60) for f in rest]
    finally:
        engine.close()

    assert [True, True] in prefills  # the two scored prompts in one prefill (ScoreTokens' sequences batch)
    assert all(all(p) or not any(p) for p in prefills)  # never a scored prompt with a plain one
    for out, ids in ((outs[1], [8, 9, 10, 11]), (outs[2], [4, 4, 5])):
        scored = out[0].prompt_logprobs
        assert scored[0] is None
        # batched with left padding and an attention mask vs alone: float32 rounding only
        torch.testing.assert_close(torch.tensor(scored[1:]), _lone_logprobs(model, ids), rtol=0, atol=1e-5)


def test_scored_prompts_share_a_prefill_only_within_max_prefill_tokens_padding_included(tiny_model_dir: Path) -> None:
    _, engine, prefills = _recording_engine(tiny_model_dir, max_prefill_tokens=7)
    try:
        first = engine.submit(GenerationInput(prompt_ids=[3, 4], max_new_tokens=30, ignore_eos=True, seed=1))
        # rows x longest: 2 x 3 = 6 fits; a third row of 4 tokens would make 3 x 4 = 12 (7 tokens unpadded)
        rest = [
            engine.submit(GenerationInput(prompt_ids=ids, max_new_tokens=1, prompt_logprobs=0))
            for ids in ([5, 6, 7], [8, 9], [4, 4, 5, 6])
        ]
        first.result(60)
        [f.result(60) for f in rest]
    finally:
        engine.close()

    assert [p for p in prefills if any(p)] == [[True, True], [True]]
