"""Continuous batching in the native engine: requests join and leave between decode steps."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from relayrl.common.model import load_model, load_tokenizer
from relayrl.config.model import ModelConfig
from relayrl.inference.engine import GenerationInput, SampleOutput, generate
from relayrl.inference.native import NativeEngine


def _engine(model_dir: Path, **kwargs: int) -> NativeEngine:
    return NativeEngine(
        load_model(ModelConfig(path=model_dir)), load_tokenizer(model_dir), torch.device("cpu"), **kwargs
    )  # type: ignore[arg-type]


def _reference(model: torch.nn.Module, prompt: list[int], sample: SampleOutput, temp: float) -> torch.Tensor:
    ids = torch.tensor([prompt + sample.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temp
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(sample.token_ids).unsqueeze(1)).squeeze(1)


def _wait_for(cond, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.0005)


def test_short_request_joins_a_running_long_one_and_finishes_first(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    long = engine.submit(GenerationInput(prompt_ids=[3, 4, 5], max_new_tokens=200, ignore_eos=True))
    _wait_for(lambda: engine.decode_steps >= 20)

    short = engine.submit(GenerationInput(prompt_ids=[6], max_new_tokens=5, ignore_eos=True))
    [s] = short.result(timeout=60)

    assert not long.done()  # the short one did not wait for the long one to end
    assert len(s.token_ids) == 5
    assert len(long.result(timeout=60)[0].token_ids) == 200
    engine.close()


def test_logprobs_stay_exact_while_rows_join_and_leave(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    prompts = [[3, 4, 5, 6, 7, 8], [9], [10, 11, 12], [5, 5], [7, 8, 9, 10]]
    futures = []
    for i, p in enumerate(prompts):  # staggered arrivals, different prompt and output lengths
        futures.append(
            engine.submit(
                GenerationInput(prompt_ids=p, n=2, temperature=0.9, max_new_tokens=4 + 7 * i, ignore_eos=True)
            )
        )
        _wait_for(lambda i=i: engine.decode_steps >= 3 * (i + 1))

    results = [f.result(timeout=60) for f in futures]

    for prompt, samples in zip(prompts, results, strict=True):
        for s in samples:
            # float32 decode over a left-padded, re-aligned KV cache vs one full forward: accumulation order only
            torch.testing.assert_close(
                torch.tensor(s.logprobs), _reference(engine.model, prompt, s, 0.9), rtol=1e-4, atol=1e-4
            )
    engine.close()


def test_samples_of_one_prompt_share_a_single_prefill(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)

    [samples] = generate(engine, [GenerationInput(prompt_ids=[3, 4, 5, 6], n=8, max_new_tokens=6, ignore_eos=True)])

    assert len(samples) == 8 and all(len(s.token_ids) == 6 for s in samples)
    assert engine.decode_steps == 6  # one prefill (samples the first token) + 5 decode steps, not 8 prefills
    engine.close()


def test_running_sequences_never_exceed_the_batch_limit_and_all_requests_finish(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, max_batch_sequences=8)
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, engine.stats().running_sequences)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    futures = [
        engine.submit(GenerationInput(prompt_ids=[3 + i % 5], n=3, max_new_tokens=10 + i, ignore_eos=True))
        for i in range(10)
    ]
    results = [f.result(timeout=120) for f in futures]
    stop.set()
    watcher.join()

    assert [len(r) for r in results] == [3] * 10
    assert [len(r[0].token_ids) for r in results] == [10 + i for i in range(10)]
    assert 3 <= peak <= 8
    engine.close()


def test_cancelled_request_leaves_the_batch(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    doomed = engine.submit(GenerationInput(prompt_ids=[3], n=4, max_new_tokens=220, ignore_eos=True))
    _wait_for(lambda: engine.stats().running_sequences == 4)

    assert doomed.cancel()
    _wait_for(lambda: engine.stats().running_sequences == 0)
    [s] = generate(engine, [GenerationInput(prompt_ids=[3], max_new_tokens=3)])[0]

    assert 1 <= len(s.token_ids) <= 3
    engine.close()


def test_seeded_request_is_reproducible_while_other_requests_run(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    seeded = GenerationInput(prompt_ids=[3, 4], n=3, max_new_tokens=8, seed=7, ignore_eos=True)
    alone = generate(engine, [seeded])[0]

    noise = [
        engine.submit(GenerationInput(prompt_ids=[5, 6, 7], n=4, max_new_tokens=30, ignore_eos=True)) for _ in range(3)
    ]
    crowded = engine.submit(seeded)
    more_noise = engine.submit(GenerationInput(prompt_ids=[8], n=2, max_new_tokens=12))

    assert [s.token_ids for s in crowded.result(timeout=60)] == [s.token_ids for s in alone]
    for f in [*noise, more_noise]:
        f.result(timeout=60)
    engine.close()


def test_request_beyond_the_context_is_refused_at_submit(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)

    with pytest.raises(ValueError, match="context length"):
        engine.submit(GenerationInput(prompt_ids=[3] * 250, max_new_tokens=10))
    engine.close()
