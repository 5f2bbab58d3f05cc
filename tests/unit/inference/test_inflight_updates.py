"""Weight swaps during a generation: between decode steps, stamped per token, KV cache per policy."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.weights import model_tensors
from relayrl.config.inference import KvOnUpdate
from relayrl.config.model import ModelConfig
from relayrl.inference.engine import GenerationInput, SampleOutput, generate
from relayrl.inference.native import NativeEngine

PROMPT = [3, 4, 5]


def _engine(model_dir: Path, policy: KvOnUpdate) -> NativeEngine:
    return NativeEngine(
        load_model(ModelConfig(path=model_dir)), load_tokenizer(model_dir), torch.device("cpu"), kv_on_update=policy
    )


def _perturbed(engine: NativeEngine, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in model_tensors(engine.model).items()}


def _generate_with_swaps(
    engine: NativeEngine, updates: list[dict[str, torch.Tensor]], at_steps: list[int], max_new_tokens: int
) -> SampleOutput:
    """Generate one long sample in a thread and swap weights when the engine reaches the given steps."""
    out: list[list[list[SampleOutput]]] = []
    inp = GenerationInput(prompt_ids=PROMPT, n=1, max_new_tokens=max_new_tokens, ignore_eos=True, seed=0)
    start = engine.decode_steps
    worker = threading.Thread(target=lambda: out.append(generate(engine, [inp])))
    worker.start()
    for version, (tensors, step) in enumerate(zip(updates, at_steps, strict=True), start=1):
        deadline = time.monotonic() + 30
        while engine.decode_steps < start + step and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.0002)
        engine.update_weights(tensors, version=version)
    worker.join(60)
    return out[0][0][0]


def _reference(model_dir: Path, weights: dict[int, dict[str, torch.Tensor]], sample: SampleOutput) -> torch.Tensor:
    """Each token's logprob from a full forward of the weights of the version stamped on it."""
    model = load_model(ModelConfig(path=model_dir))
    ids = torch.tensor([PROMPT + sample.token_ids])
    out = torch.empty(len(sample.token_ids))
    for version in sorted(set(sample.weight_versions)):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[version][name])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        for t, v in enumerate(sample.weight_versions):
            if v == version:
                out[t] = logp[len(PROMPT) - 1 + t, sample.token_ids[t]]
    return out


@pytest.mark.parametrize("policy", [KvOnUpdate.RECOMPUTE, KvOnUpdate.KEEP])
def test_long_generation_spans_two_updates_with_non_decreasing_versions(
    tiny_model_dir: Path, policy: KvOnUpdate
) -> None:
    engine = _engine(tiny_model_dir, policy)
    updates = [_perturbed(engine, 1), _perturbed(engine, 2)]

    sample = _generate_with_swaps(engine, updates, at_steps=[20, 60], max_new_tokens=120)

    assert len(sample.token_ids) == 120  # nothing was aborted or dropped by the swaps
    assert sample.weight_versions == sorted(sample.weight_versions)
    assert set(sample.weight_versions) == {0, 1, 2}


def test_recompute_policy_gives_exact_logprobs_of_the_stamped_version(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, KvOnUpdate.RECOMPUTE)
    weights = {0: {k: v.clone() for k, v in model_tensors(engine.model).items()}}
    weights[1], weights[2] = _perturbed(engine, 1), _perturbed(engine, 2)

    sample = _generate_with_swaps(engine, [weights[1], weights[2]], at_steps=[10, 30], max_new_tokens=50)

    assert set(sample.weight_versions) == {0, 1, 2}
    # float32 KV-cache decode vs one full forward: accumulation order only
    torch.testing.assert_close(
        torch.tensor(sample.logprobs), _reference(tiny_model_dir, weights, sample), rtol=1e-4, atol=1e-4
    )


def test_keep_policy_reuses_old_keys_and_values_after_a_swap(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, KvOnUpdate.KEEP)
    weights = {0: {k: v.clone() for k, v in model_tensors(engine.model).items()}, 1: _perturbed(engine, 1)}

    sample = _generate_with_swaps(engine, [weights[1]], at_steps=[10], max_new_tokens=30)

    ref = _reference(tiny_model_dir, weights, sample)
    got = torch.tensor(sample.logprobs)
    before = [t for t, v in enumerate(sample.weight_versions) if v == 0]
    after = [t for t, v in enumerate(sample.weight_versions) if v == 1]
    assert before and after
    torch.testing.assert_close(got[before], ref[before], rtol=1e-4, atol=1e-4)
    # after the swap the cache still holds the old weights' keys/values: not the new policy exactly
    assert float((got[after] - ref[after]).abs().max()) > 1e-3
