"""LoRA: the trainer trains a peft adapter, publishes only the adapter (verified by the probe on base + adapter
served by the native engine), checkpoints only the adapter, resumes it, and merges it into a full model."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch

from relayrl.cli import main
from relayrl.common.lora import with_lora
from relayrl.common.model import chat_token_ids, load_model, load_tokenizer
from relayrl.common.weights import iter_update_messages
from relayrl.config.lora import LoraConfig
from relayrl.config.model import ModelConfig
from relayrl.config.publication import WeightTransport
from relayrl.config.trainer import TrainerConfig
from relayrl.trainer.checkpoint import save_checkpoint
from relayrl.trainer.learner import Learner
from relayrl.trainer.lora import load_policy
from relayrl.trainer.transports import make_transport
from relayrl.trainer.weight_sync import WeightPublisher
from tests.conftest import WEIGHTS_TOKEN
from tests.integration.helpers import inference_server

pytest.importorskip("peft")
pytestmark = pytest.mark.integration
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
CHAT = [{"role": "user", "content": "What is 17 + 25?"}]


def _trained_policy(model_dir: Path, steps: int = 3) -> tuple[torch.nn.Module, Learner]:
    """The trainer's model (base + adapter) after a few supervised steps with a high learning rate, so the adapter
    is far from its zero start."""
    tok = load_tokenizer(model_dir)
    model = load_policy(ModelConfig(path=model_dir, lora=LORA))
    cfg = TrainerConfig()
    cfg.optimizer.lr = 5e-2
    learner = Learner(model, cfg, int(tok.pad_token_id), torch.device("cpu"))
    prompt, answer = chat_token_ids(tok, CHAT), tok("The answer is 42.", add_special_tokens=False)["input_ids"]
    for _ in range(steps):
        learner.sft_step([prompt] * 2, [answer] * 2)
    return model, learner


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits.float()


async def test_only_the_adapter_is_published_and_the_probe_verifies_base_plus_adapter(
    chat_model_dir: Path, tmp_path: Path
) -> None:
    model, _ = _trained_policy(chat_model_dir)
    tok = load_tokenizer(chat_model_dir)
    probe = WeightPublisher.default_probe(model, tok, sequences=4, tokens=24, seed=0)

    async def go() -> None:
        async with inference_server(chat_model_dir, lora=LORA) as (_, service):
            base_before = {
                n: p.clone()
                for n, p in service.engine.model.named_parameters()  # type: ignore[attr-defined]
                if not p.requires_grad
            }
            pub = WeightPublisher(
                model,
                torch.device("cpu"),
                service.weights_target,
                make_transport(WeightTransport.GRPC_STREAM, 1 << 20, tmp_path),
                timeout_s=30,
                probe=probe,
                probe_tolerance=None,
                token=WEIGHTS_TOKEN,
            )
            snapshot = pub.snapshot()
            result = await pub.push(snapshot, 1)

            assert snapshot and all(".lora_A." in n or ".lora_B." in n for n in snapshot)
            full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            assert result.bytes_sent == sum(t.numel() * t.element_size() for t in snapshot.values())
            assert result.bytes_sent < full_bytes / 10
            assert service.engine.version == 1
            assert result.probe_max_diff is not None and result.probe_max_diff <= 1e-5  # float32: order only
            served = dict(service.engine.model.named_parameters())  # type: ignore[attr-defined]
            for name, t in snapshot.items():
                assert torch.equal(served[name], t)
            for name, t in base_before.items():  # the frozen base never travels nor changes
                assert torch.equal(served[name], t)
            ids = chat_token_ids(tok, CHAT)
            base = load_model(ModelConfig(path=chat_model_dir))
            assert (_logits(service.engine.model, ids) - _logits(base, ids)).abs().max() > 1e-3  # adapter applied

    await go()


async def test_a_full_weight_update_to_a_lora_server_is_refused(chat_model_dir: Path) -> None:
    full = {n: p.detach() for n, p in load_model(ModelConfig(path=chat_model_dir)).named_parameters()}

    async def go() -> None:
        from relayrl.client import InferenceClient

        async with (
            inference_server(chat_model_dir, lora=LORA) as (_, service),
            InferenceClient(service.weights_target, token=WEIGHTS_TOKEN) as client,
        ):
            await client.update_weights(list(iter_update_messages(full, 1, 1 << 20)), 1, 30, attempts=1)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await go()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_checkpoint_holds_only_the_adapter_resumes_it_and_merges_into_a_full_model(
    chat_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model, learner = _trained_policy(chat_model_dir)
    tok = load_tokenizer(chat_model_dir)
    ckpt = save_checkpoint(tmp_path / "ckpt", 3, 7, model, tok, learner.optimizer, keep=2, extra={})
    ids = chat_token_ids(tok, CHAT)

    files = {p.name for p in (ckpt / "model").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    assert json.loads((ckpt / "model" / "adapter_config.json").read_text())["r"] == LORA.rank
    resumed = load_policy(ModelConfig(path=chat_model_dir, lora=LORA), ckpt / "model")
    assert any(p.requires_grad for p in resumed.parameters())  # trainable again
    torch.testing.assert_close(_logits(resumed, ids), _logits(model, ids), rtol=0, atol=1e-6)  # same weights
    assert main(["merge-lora", str(ckpt), "--base", str(chat_model_dir), "--out", str(tmp_path / "merged")]) == 0
    merged = tmp_path / "merged"
    plain = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)  # no peft needed to load it
    assert not any("lora" in n for n, _ in plain.named_parameters())
    # merging adds (alpha/r) B A into each float32 weight: rounding of that sum only
    torch.testing.assert_close(_logits(plain, ids), _logits(model, ids), rtol=0, atol=1e-4)


def test_resuming_a_full_weight_checkpoint_with_lora_enabled_is_refused(chat_model_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="not a LoRA adapter"):
        load_policy(ModelConfig(path=chat_model_dir, lora=LORA), chat_model_dir)


def test_bfloat16_base_keeps_a_float32_adapter_on_both_sides(chat_model_dir: Path) -> None:
    cfg = ModelConfig(path=chat_model_dir, dtype="bfloat16", lora=LORA)

    trainer_side = load_policy(cfg)
    served = with_lora(load_model(cfg), LORA)

    adapter = {n: p for n, p in trainer_side.named_parameters() if p.requires_grad}
    assert adapter and {p.dtype for p in adapter.values()} == {torch.float32}  # float32 master weights
    assert {p.dtype for p in trainer_side.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {n: (p.dtype, p.shape) for n, p in served.named_parameters() if p.requires_grad} == {
        n: (p.dtype, p.shape) for n, p in adapter.items()
    }
