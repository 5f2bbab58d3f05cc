"""A sharded (FSDP2) publication streams: each full tensor is gathered, written into the transport's file (and its
checksum) or read back as chunks, and dropped, so rank 0 never holds more than one full tensor beside its shards.

The gather runs under torch's fake process group (one process, rank 0 of 2: the collectives return tensors of the
right shape without moving data). Full tensors are counted where they are made, ``DTensor.full_tensor``, by their
storages: a storage stays counted until the last tensor viewing it is gone, whatever aliases the code kept. Real
ranks exchanging real data are tested in tests/distributed/test_trainer_fsdp.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from relayrl.common.model import load_model
from relayrl.common.pb import inference_pb2
from relayrl.common.probe import probe_sequences
from relayrl.common.tensor_views import packed_copy
from relayrl.common.weights import (
    TensorSpec,
    WeightAssembler,
    checksum,
    dtype_name,
    hash_header,
    hasher,
    iter_update_messages,
    parameter_specs,
    tensor_bytes,
)
from relayrl.config.model import ModelConfig
from relayrl.config.publication import WeightTransport
from relayrl.trainer.parallel_dims import ParallelDims, apply_fsdp
from relayrl.trainer.transports import make_transport
from relayrl.trainer.weight_files import FileUpdateMessages, MappedWeights, StreamedWriter, write_mapped
from relayrl.trainer.weight_sync import WeightPublisher


class FullTensorCount:
    """Wraps ``DTensor.full_tensor``: bytes and number of full tensors alive now and at most, and a running
    checksum (the project's, by ``algorithm``, in call order) of every full tensor handed out."""

    def __init__(self, original: Any, algorithm: int = inference_pb2.CHECKSUM_ALGORITHM_SHA256) -> None:
        self.original = original
        self.alive_bytes = self.alive = self.peak_bytes = self.peak = self.calls = 0
        self.sha = hasher(algorithm)

    def __call__(self, dtensor: DTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        full: torch.Tensor = self.original(dtensor, *args, **kwargs)
        storage = full.untyped_storage()
        nbytes = storage.nbytes()
        self.calls += 1
        self.alive, self.alive_bytes = self.alive + 1, self.alive_bytes + nbytes
        self.peak, self.peak_bytes = max(self.peak, self.alive), max(self.peak_bytes, self.alive_bytes)
        weakref.finalize(storage, self._freed, nbytes)
        return full

    def _freed(self, nbytes: int) -> None:
        self.alive, self.alive_bytes = self.alive - 1, self.alive_bytes - nbytes

    def hash(self, name: str, full: torch.Tensor) -> None:
        hash_header(self.sha, name, dtype_name(full.dtype), tuple(full.shape))
        self.sha.update(tensor_bytes(full))


@pytest.fixture
def sharded(tiny_model_dir: Path) -> Iterator[tuple[Any, Any]]:
    """(model sharded by FSDP2 as rank 0 of 2, the plain architecture rank 0 probes with)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = ParallelDims(1, 2, 1, 1, 2).build_mesh("cpu")
        yield (
            apply_fsdp(load_model(ModelConfig(path=tiny_model_dir)), mesh),
            load_model(ModelConfig(path=tiny_model_dir)),
        )
    finally:
        dist.destroy_process_group()


def _publisher(model: Any, plain: Any, transport: WeightTransport, weights_dir: Path) -> WeightPublisher:
    vocab = int(plain.get_input_embeddings().num_embeddings)
    return WeightPublisher(
        model,
        torch.device("cpu"),
        "unused:0",
        make_transport(transport, 4096, weights_dir),
        5.0,
        probe_sequences(vocab, 2, 6, seed=0),
        None,
        plain_model=plain,
    )


def _counted(
    monkeypatch: pytest.MonkeyPatch,
    model: Any,
    hashed: bool = False,
    algorithm: int = inference_pb2.CHECKSUM_ALGORITHM_SHA256,
) -> FullTensorCount:
    """Count (and, ``hashed``, checksum by ``algorithm``) every full tensor gathered from ``model``'s parameters."""
    count = FullTensorCount(DTensor.full_tensor, algorithm)
    names = {id(p): n for n, p in model.named_parameters()}

    def full_tensor(self: DTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        full = count(self, *args, **kwargs)
        if hashed:
            count.hash(names[id(self)], full)
        return full

    monkeypatch.setattr(DTensor, "full_tensor", full_tensor)
    return count


@pytest.mark.parametrize(
    ("transport", "algorithm"),
    [
        (WeightTransport.SHARED_MEMORY, inference_pb2.CHECKSUM_ALGORITHM_XXH3_128),  # same host, integrity only
        (WeightTransport.SHARED_PATH, inference_pb2.CHECKSUM_ALGORITHM_SHA256),
        (WeightTransport.GRPC_STREAM, inference_pb2.CHECKSUM_ALGORITHM_SHA256),
    ],
)
def test_sharded_publication_holds_one_full_tensor_at_a_time_and_sends_exactly_what_was_gathered(
    sharded: tuple[Any, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    transport: WeightTransport,
    algorithm: int,
) -> None:
    model, plain = sharded
    pub = _publisher(model, plain, transport, tmp_path / "weights")
    count = _counted(monkeypatch, model, hashed=True, algorithm=algorithm)
    largest = max(p.numel() * p.element_size() for p in model.parameters())

    pub.gather(keep=True)
    params = pub.snapshot()
    messages = pub.transport.prepare(params, 7, pub.probe)
    sent = [m for m in messages]  # what gRPC would send (grpc_stream: the chunks read one by one)
    expected = pub.expected_probe(params)

    specs = parameter_specs(plain)
    assert count.calls == len(specs)  # one gather per trained parameter
    assert count.peak == 1 and count.peak_bytes <= largest  # never two full tensors alive at once
    assert isinstance(params, MappedWeights)
    manifest = sent[-1].manifest
    assert (manifest.version, manifest.num_tensors) == (7, len(specs))
    assert manifest.checksum_algorithm == algorithm  # the transport's algorithm, named in its manifest
    assert manifest.sha256 == count.sha.hexdigest()  # the file holds exactly the gathered tensors, in name order
    tensors = params.tensors()
    assert {n: TensorSpec(t.dtype, tuple(t.shape)) for n, t in tensors.items()} == specs
    assert checksum(tensors, algorithm) == manifest.sha256  # read back through the memory map: the same bytes
    if transport is WeightTransport.GRPC_STREAM:
        assembler = WeightAssembler(specs)
        for m in sent[:-1]:
            assembler.add(m.chunk)
        assembler.finish(manifest)  # inference's own checks: every chunk in order, the checksum
    else:
        assert Path(manifest.path).samefile(params.path)  # the versioned name links the gathered file
    assert expected.shape == (2 * 5,)  # the probe scored the file's tensors with the plain architecture


def test_the_probe_of_a_gathered_file_equals_the_probe_of_the_same_tensors_in_memory(
    sharded: tuple[Any, Any], tmp_path: Path
) -> None:
    model, plain = sharded
    pub = _publisher(model, plain, WeightTransport.SHARED_MEMORY, tmp_path)
    pub.gather(keep=True)
    params = pub.snapshot()
    assert isinstance(params, MappedWeights)
    in_memory = {n: t.clone() for n, t in params.tensors().items()}

    from_file = pub.expected_probe(params)

    # the same model on bit-identical tensors, the same kernels: no rounding can differ
    torch.testing.assert_close(from_file, pub.expected_probe(in_memory), rtol=0, atol=0)


def test_a_write_that_fails_on_rank_0_still_runs_every_gather_then_raises_and_leaves_no_file(
    sharded: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, plain = sharded
    pub = _publisher(model, plain, WeightTransport.SHARED_MEMORY, tmp_path)
    count = _counted(monkeypatch, model)
    written = 0
    add = StreamedWriter.add

    def failing_add(self: StreamedWriter, name: str, tensor: torch.Tensor) -> None:
        nonlocal written
        if written == 2:
            raise OSError(28, "No space left on device")
        written += 1
        add(self, name, tensor)

    monkeypatch.setattr(StreamedWriter, "add", failing_add)

    with pytest.raises(RuntimeError, match="No space left"):
        pub.gather(keep=True)

    assert count.calls == len(list(model.parameters()))  # the same collectives as the other ranks ran
    assert list(tmp_path.iterdir()) == []  # the partial file is gone
    with pytest.raises(RuntimeError, match="no gathered weights"):
        pub.snapshot()


def test_a_new_gather_removes_the_previous_file_while_its_push_still_reads_it(
    sharded: tuple[Any, Any], tmp_path: Path
) -> None:
    model, plain = sharded
    pub = _publisher(model, plain, WeightTransport.GRPC_STREAM, tmp_path)
    pub.gather(keep=True)
    first = pub.snapshot()
    assert pub.snapshot() is first  # a re-push (the watchdog's) sends the same file again
    assert isinstance(first, MappedWeights)
    in_flight = pub.transport.prepare(first, 1, [])

    pub.gather(keep=True)

    assert not first.path.exists() and pub.snapshot() is not first
    assert [p.name for p in tmp_path.iterdir()] == [pub.snapshot().path.name]  # type: ignore[union-attr]
    replay = [m.SerializeToString() for m in in_flight]  # the open file is still read, in full
    assert replay == [m.SerializeToString() for m in pub.transport.prepare(first, 1, [])]
    first.link(tmp_path / "copy.safetensors")  # its name is gone: a copy through the open file
    assert (
        checksum(
            MappedWeights(
                tmp_path / "copy.safetensors",
                first.specs,
                first.data_start,
                first.total_bytes,
                first.sha256,
                first.algorithm,
            ).tensors(),
            first.algorithm,
        )
        == first.sha256
    )


@pytest.mark.parametrize("chunk_bytes", [1, 100, 4096, 1 << 20])
def test_chunks_read_from_a_file_are_the_chunks_of_the_same_tensors_in_memory(tmp_path: Path, chunk_bytes: int) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "b.weight": torch.randn(30, 50, generator=g),
        "a.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }
    writer = StreamedWriter(
        tmp_path / "w.safetensors", {n: TensorSpec(t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    )
    for name in writer.names:
        writer.add(name, tensors[name])
    weights = writer.finish()
    probe = [[1, 2, 3]]

    from_file = FileUpdateMessages(weights, 3, chunk_bytes, probe)

    expected = [m.SerializeToString() for m in iter_update_messages(tensors, 3, chunk_bytes, probe)]
    assert [m.SerializeToString() for m in from_file] == expected
    assert len(from_file) == len(expected) and from_file[-1].SerializeToString() == expected[-1]
    assert [m.SerializeToString() for m in from_file[1:3]] == expected[1:3]


def test_tensors_out_of_name_order_or_of_another_shape_are_refused_by_the_writer(tmp_path: Path) -> None:
    writer = StreamedWriter(
        tmp_path / "w.safetensors", {"a": TensorSpec(torch.float32, (2,)), "b": TensorSpec(torch.float32, (3,))}
    )
    with pytest.raises(ValueError, match="out of order"):
        writer.add("b", torch.zeros(3))
    with pytest.raises(ValueError, match=r"float32\[3\] != float32\[2\]"):
        writer.add("a", torch.zeros(3))
    writer.add("a", torch.zeros(2))
    with pytest.raises(ValueError, match="never written"):
        writer.finish()
    assert list(tmp_path.iterdir()) == []


def test_a_file_written_at_once_equals_the_same_tensors_streamed_one_by_one_and_names_its_algorithm(
    tmp_path: Path,
) -> None:
    g = torch.Generator().manual_seed(0)
    packed = packed_copy(
        {
            "b.weight": torch.randn(30, 50, generator=g),
            "a.bias": torch.randn(7, generator=g),
            "empty": torch.zeros(0, 4),
        }
    )  # one storage: write_mapped cuts every tensor's bytes from it
    xxh3 = inference_pb2.CHECKSUM_ALGORITHM_XXH3_128
    writer = StreamedWriter(
        tmp_path / "streamed.safetensors", {n: TensorSpec(t.dtype, tuple(t.shape)) for n, t in packed.items()}, xxh3
    )
    for name in writer.names:
        writer.add(name, packed[name].clone())  # each tensor alone, in its own storage
    streamed = writer.finish()

    m = write_mapped(packed, 3, [], tmp_path / "v000000003.shm.safetensors")

    assert (tmp_path / "streamed.safetensors").read_bytes() == Path(m.path).read_bytes()
    assert (m.checksum_algorithm, m.sha256) == (xxh3, streamed.sha256) == (xxh3, checksum(packed, xxh3))
    assert streamed.manifest(3, []).checksum_algorithm == xxh3


def test_a_transport_refuses_a_gathered_file_hashed_by_another_algorithm(tmp_path: Path) -> None:
    t = {"w": torch.ones(4)}
    writer = StreamedWriter(
        tmp_path / "g.safetensors", {"w": TensorSpec(torch.float32, (4,))}, inference_pb2.CHECKSUM_ALGORITHM_XXH3_128
    )
    writer.add("w", t["w"])
    gathered = writer.finish()

    for transport in (WeightTransport.GRPC_STREAM, WeightTransport.SHARED_PATH):  # SHA-256 only: never XXH3
        with pytest.raises(ValueError, match="hashed with checksum algorithm"):
            make_transport(transport, 4096, tmp_path / "weights").prepare(gathered, 1, [])
