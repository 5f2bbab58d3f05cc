"""LoRA on the vLLM backend: an adapter-only weight update is served as a vLLM adapter, verified by the probe, and
every token carries the version of the adapter that produced it (also for a request in flight across the swap);
a target module vLLM does not serve LoRA on is refused at start-up."""

from __future__ import annotations

import stat
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.common.model import load_model
from relayrl.common.probe import PROBE_TOLERANCE, probe_logprobs
from relayrl.config.inference import EngineKind, InferenceConfig, KvOnUpdate
from relayrl.config.lora import LoraConfig
from relayrl.config.model import ModelConfig
from relayrl.config.typed import ConfigError
from relayrl.inference.engine import GenerationInput, TokenEvent, generate
from relayrl.trainer.lora import load_policy

pytestmark = pytest.mark.vllm
pytest.importorskip("peft")

# q and v without k, gate without up: vLLM packs q/k/v and gate/up into one layer each and must serve a partial pack
LORA = LoraConfig(
    enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
)
PROBE = [[4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [17, 3, 3, 9, 14, 5]]
PROMPT = [4, 5, 6]
# vLLM's CPU LoRA kernels + attention vs peft's float32 forward: reduction order only (measured <= 2e-6)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("vllm_lora") / "tiny", TinyModelConfig(seed=5))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Any]:
    from relayrl.inference.vllm_engine import VllmEngine

    eng = VllmEngine(
        ModelConfig(path=model_dir, lora=LORA), InferenceConfig(engine=EngineKind.VLLM, max_batch_sequences=16)
    )
    yield eng
    eng.close()


def _policy(model_dir: Path, seed: int) -> torch.nn.Module:
    """The trainer's base + adapter with a random adapter (B != 0, so it changes the model), in eval mode."""
    model = load_policy(ModelConfig(path=model_dir, lora=LORA))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()  # type: ignore[no-any-return]


def _adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _reference(model: torch.nn.Module, prompt: list[int], tokens: list[int], temp: float) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temp
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def test_adapter_update_is_served_probe_verified_and_stamped_with_its_version(engine: Any, model_dir: Path) -> None:
    policy = _policy(model_dir, 1)
    adapter = _adapter(policy)
    base = load_model(ModelConfig(path=model_dir))
    version = engine.version + 1

    served = torch.tensor(engine.update_weights(adapter, version, PROBE))
    [[s]] = generate(
        engine, [GenerationInput(prompt_ids=PROMPT, max_new_tokens=8, temperature=0.8, ignore_eos=True)], timeout=300
    )

    assert set(engine.specs) == set(adapter) and all(".lora_" in n for n in adapter)  # the adapter only
    expected = probe_logprobs(policy, PROBE, torch.device("cpu"))
    assert float((served - expected).abs().max()) <= PROBE_TOLERANCE[torch.float32]
    assert float((served - probe_logprobs(base, PROBE, torch.device("cpu"))).abs().max()) > 0.1  # not the base
    assert s.weight_versions == [version] * 8
    torch.testing.assert_close(
        torch.tensor(s.logprobs), _reference(policy, PROMPT, s.token_ids, 0.8), rtol=0, atol=ATOL
    )
    adapter_dir = engine._store.root / f"v{version:09d}"
    assert stat.S_IMODE(engine._store.root.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in adapter_dir.iterdir()} == {0o600}  # no other user reads it


def test_request_in_flight_goes_on_under_the_new_adapter_and_the_old_one_is_removed(
    engine: Any, model_dir: Path
) -> None:
    first, second = _policy(model_dir, 2), _policy(model_dir, 3)
    v1 = engine.version + 1
    engine.update_weights(_adapter(first), v1)
    tokens = threading.Semaphore(0)

    def on_token(event: TokenEvent) -> None:
        tokens.release()

    future = engine.submit(
        GenerationInput(prompt_ids=PROMPT, max_new_tokens=200, temperature=0.9, ignore_eos=True, on_token=on_token)
    )
    for _ in range(4):  # the request has produced 4 tokens on the first adapter
        assert tokens.acquire(timeout=120)
    engine.update_weights(_adapter(second), v1 + 1)  # kv_on_update: recompute (the default)
    [s] = future.result(timeout=300)

    switch = s.weight_versions.index(v1 + 1)
    assert switch >= 4 and s.weight_versions == [v1] * switch + [v1 + 1] * (200 - switch)
    # every token's logprob is the one of the adapter stamped on it: the rest was prefilled under the new one
    reference = torch.cat(
        [_reference(first, PROMPT, s.token_ids, 0.9)[:switch], _reference(second, PROMPT, s.token_ids, 0.9)[switch:]]
    )
    torch.testing.assert_close(torch.tensor(s.logprobs), reference, rtol=0, atol=ATOL)
    assert engine._engine.list_loras() == {v1 + 1}  # nothing uses the first adapter any more
    assert [p.name for p in engine._store.root.iterdir()] == [f"v{v1 + 1:09d}"]


def test_request_in_flight_under_keep_finishes_on_its_own_adapter_and_version(engine: Any, model_dir: Path) -> None:
    first, second = _policy(model_dir, 4), _policy(model_dir, 5)
    v1 = engine.version + 1
    engine.update_weights(_adapter(first), v1)
    tokens = threading.Semaphore(0)
    engine.cfg = replace(engine.cfg, kv_on_update=KvOnUpdate.KEEP)  # read at each swap; LoRA's prefix cache is
    try:  # keyed by adapter, so no block of one adapter is reused under another either way
        future = engine.submit(
            GenerationInput(
                prompt_ids=PROMPT,
                max_new_tokens=200,
                temperature=0.9,
                ignore_eos=True,
                on_token=lambda event: tokens.release(),
            )
        )
        for _ in range(4):
            assert tokens.acquire(timeout=120)
        engine.update_weights(_adapter(second), v1 + 1)
        [[after]] = generate(
            engine,
            [GenerationInput(prompt_ids=PROMPT, max_new_tokens=4, temperature=0.9, ignore_eos=True)],
            timeout=300,
        )
        [s] = future.result(timeout=300)
    finally:
        engine.cfg = replace(engine.cfg, kv_on_update=KvOnUpdate.RECOMPUTE)

    assert s.weight_versions == [v1] * 200 and after.weight_versions == [v1 + 1] * 4
    torch.testing.assert_close(
        torch.tensor(s.logprobs), _reference(first, PROMPT, s.token_ids, 0.9), rtol=0, atol=ATOL
    )  # the whole sample on the first adapter
    assert engine._engine.list_loras() == {v1 + 1}  # the first one went when its last request finished


def test_target_module_vllm_serves_no_lora_on_is_refused_at_start_up(model_dir: Path) -> None:
    # last in this module: the refused engine's teardown also ends the process's vLLM state the module's engine uses
    from relayrl.inference.vllm_engine import VllmEngine

    lora = LoraConfig(enabled=True, rank=4, target_modules=["q_proj", "embed_tokens"])

    with pytest.raises(ConfigError) as info:
        VllmEngine(ModelConfig(path=model_dir, lora=lora), InferenceConfig(engine=EngineKind.VLLM))

    assert "model.lora.target_modules" in str(info.value) and "embed_tokens" in str(info.value)
