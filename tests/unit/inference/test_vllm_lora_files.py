"""The vLLM backend's LoRA adapter files (relayrl.inference.vllm_lora), without vLLM: an update written by the
adapter store is a peft adapter directory that loads back into exactly the trainer's model, readable by its owner
only; the specs it expects are the trainer's; vLLM's rank and module limits are refused with the field named."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from relayrl.common.model import load_model
from relayrl.common.weights import parameter_specs
from relayrl.config.lora import LoraConfig
from relayrl.config.model import ModelConfig
from relayrl.config.typed import ConfigError
from relayrl.inference.vllm_lora import AdapterStore, adapter_specs, check_targets, max_lora_rank
from relayrl.trainer.lora import load_policy

pytest.importorskip("peft")
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["all-linear"])


def _trained(model_dir: Path) -> torch.nn.Module:
    model = load_policy(ModelConfig(path=model_dir, lora=LORA))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()  # type: ignore[no-any-return]


def test_written_adapter_loads_back_into_the_trainers_model_and_only_its_owner_reads_it(tiny_model_dir: Path) -> None:
    from peft import PeftModel

    policy = _trained(tiny_model_dir)
    adapter = {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad}
    specs, targets = adapter_specs(str(tiny_model_dir), torch.float32, LORA)
    store = AdapterStore(LORA, targets)
    try:
        out = store.write(7, adapter)

        loaded = PeftModel.from_pretrained(load_model(ModelConfig(path=tiny_model_dir)), str(out)).eval()
        ids = torch.tensor([[4, 5, 6, 7, 8, 9]])
        with torch.no_grad():
            # the same float32 weights through the same peft forward: equal up to nothing but identical ops
            torch.testing.assert_close(loaded(input_ids=ids).logits, policy(input_ids=ids).logits, rtol=0, atol=1e-6)
        assert specs == parameter_specs(policy)  # what the trainer sends, from the config alone
        assert targets == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
        assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o600}
    finally:
        store.close()
    assert not store.root.exists()


def test_adapter_nothing_uses_is_released_but_the_served_one_is_kept(tiny_model_dir: Path) -> None:
    store = AdapterStore(LORA, ["q_proj"])
    try:
        store.acquire(1)
        store.acquire(2)
        store.release(1)
        store.release(2)

        assert store.unused(current=2) == [1]  # version 2 is served: new requests will use it
        assert store.unused(current=3) == [2]
    finally:
        store.close()


def test_vllm_limits_are_refused_naming_the_field_value_and_rule() -> None:
    assert (max_lora_rank(1), max_lora_rank(4), max_lora_rank(16), max_lora_rank(300)) == (1, 8, 16, 320)
    with pytest.raises(ConfigError, match=r"model\.lora\.rank = 1000: must be <= 512"):
        max_lora_rank(1000)
    with pytest.raises(
        ConfigError,
        match=r"model\.lora\.target_modules = \['q_proj', 'embed_tokens'\]: .*"
        r"not on \['embed_tokens'\]",
    ):
        check_targets(
            ["embed_tokens", "q_proj"],
            ["k_proj", "q_proj"],
            LoraConfig(enabled=True, target_modules=["q_proj", "embed_tokens"]),
        )
