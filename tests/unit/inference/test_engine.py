"""The native engine against plain Hugging Face forward passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH, FINISH_REASON_STOP, FINISH_REASON_STOP_STRING
from relayrl.common.weights import WeightUpdateError, model_tensors
from relayrl.config.model import ModelConfig
from relayrl.inference.engine import GenerationInput, generate, sample_tokens
from relayrl.inference.native import NativeEngine


@pytest.fixture
def engine(tiny_model_dir: Path) -> NativeEngine:
    cfg = ModelConfig(path=tiny_model_dir)
    return NativeEngine(load_model(cfg), load_tokenizer(tiny_model_dir), torch.device("cpu"))


def _reference_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int], temp: float) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temp
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


def test_logprobs_equal_a_full_forward_of_the_sampled_sequence(engine: NativeEngine) -> None:
    prompts = [[3, 4, 5], [6, 7]]  # different lengths: exercises left padding and position ids

    out = generate(engine, [GenerationInput(prompt_ids=p, n=2, temperature=0.8, max_new_tokens=6) for p in prompts])

    for prompt, samples in zip(prompts, out, strict=True):
        for s in samples:
            ref = _reference_logprobs(engine.model, prompt, s.token_ids, 0.8)
            # float32 KV-cache decode vs one full forward: differences are accumulation order only
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, rtol=1e-4, atol=1e-4)


def test_every_token_is_stamped_with_the_served_version(engine: NativeEngine) -> None:
    engine.update_weights(model_tensors(engine.model), version=3)

    [[s]] = generate(engine, [GenerationInput(prompt_ids=[3, 4], n=1, max_new_tokens=5)])

    assert s.weight_versions == [3] * len(s.token_ids)
    assert len(s.logprobs) == len(s.token_ids) >= 1


def test_finish_reason_is_length_exactly_when_max_new_tokens_ran_out(engine: NativeEngine) -> None:
    [samples] = generate(engine, [GenerationInput(prompt_ids=[3], n=32, max_new_tokens=4)])

    for s in samples:
        assert 1 <= len(s.token_ids) <= 4
        ended_on_eos = s.token_ids[-1] == engine.eos_token_id
        assert engine.eos_token_id not in s.token_ids[:-1]  # nothing is generated after a stop
        assert s.finish_reason == (FINISH_REASON_STOP if ended_on_eos else FINISH_REASON_LENGTH)
        assert ended_on_eos or len(s.token_ids) == 4
    assert any(s.finish_reason == FINISH_REASON_LENGTH for s in samples)


def test_stop_token_ids_end_the_sample_including_the_stop_token(engine: NativeEngine) -> None:
    vocab = engine.model.get_input_embeddings().num_embeddings
    every_token = list(range(vocab))

    [[s]] = generate(engine, [GenerationInput(prompt_ids=[3], n=1, max_new_tokens=5, stop_token_ids=every_token)])

    assert len(s.token_ids) == 1
    assert s.finish_reason == FINISH_REASON_STOP


def test_stop_string_cuts_the_text(engine: NativeEngine) -> None:
    chars = [engine.tokenizer.decode([i]) for i in range(engine.model.get_input_embeddings().num_embeddings)]
    stops = [c for c in chars if c]  # any visible character stops generation

    [samples] = generate(engine, [GenerationInput(prompt_ids=[3], n=32, max_new_tokens=6, stop=stops)])

    by_string = [s for s in samples if s.finish_reason == FINISH_REASON_STOP_STRING]
    assert by_string  # 15 of the 18 tokens are visible characters: some sample must hit one
    for s in by_string:
        assert len(s.text) == 1 and s.text in stops


def test_same_seed_gives_the_same_samples(engine: NativeEngine) -> None:
    inp = GenerationInput(prompt_ids=[3, 4], n=3, max_new_tokens=6, seed=123)

    a = generate(engine, [inp])[0]
    b = generate(engine, [inp])[0]

    assert [s.token_ids for s in a] == [s.token_ids for s in b]


def test_update_with_an_older_version_is_refused_and_weights_keep_serving(engine: NativeEngine) -> None:
    engine.update_weights(model_tensors(engine.model), version=5)
    before = {k: v.clone() for k, v in model_tensors(engine.model).items()}
    bumped = {k: v + 1 for k, v in before.items()}

    with pytest.raises(WeightUpdateError):
        engine.update_weights(bumped, version=5)

    assert engine.version == 5
    assert all(torch.equal(before[k], v) for k, v in model_tensors(engine.model).items())


def test_tied_embeddings_stay_tied_after_an_update(engine: NativeEngine) -> None:
    new = {k: torch.randn_like(v) for k, v in model_tensors(engine.model).items()}

    engine.update_weights(new, version=1)

    emb = engine.model.get_input_embeddings().weight
    head = engine.model.get_output_embeddings().weight
    assert engine.model.config.tie_word_embeddings
    assert torch.equal(emb, head)
    assert torch.equal(emb, new["model.embed_tokens.weight"])


def test_top_k_one_samples_the_argmax_with_full_softmax_logprob() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]])

    tok, lp = sample_tokens(logits, torch.ones(2), torch.tensor([1, 1]), torch.ones(2), None)

    assert tok.tolist() == [1, 2]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[[0, 1], [1, 2]], rtol=0, atol=1e-6)


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(200, 1)
    gen = torch.Generator().manual_seed(0)

    tok, _ = sample_tokens(logits, torch.ones(200), torch.zeros(200, dtype=torch.long), torch.full((200,), 0.5), gen)

    assert set(tok.tolist()) == {0}  # 0.6 alone already covers top_p = 0.5
