"""Logprob alternatives and per-token streaming in the native engine, for a request that joins a running batch
whose rows asked for none (the batch's alternatives tensor grows on concat)."""

from __future__ import annotations

import threading
from pathlib import Path

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
        plain = engine.submit(GenerationInput(prompt_ids=[3, 4, 5], max_new_tokens=40, ignore_eos=True,
                                              on_token=lambda _: started.set()))
        assert started.wait(30)  # the plain request is decoding: the next one joins by concat
        asked = engine.submit(GenerationInput(prompt_ids=[6, 7], max_new_tokens=8, ignore_eos=True,
                                              temperature=0.8, top_logprobs=3, on_token=events.append))
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
