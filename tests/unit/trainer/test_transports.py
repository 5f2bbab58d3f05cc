"""Choosing the weight transport, and the shared-memory file format (a safetensors file any reader loads, with the
checksum computed while writing equal to the one inference recomputes)."""

from __future__ import annotations

import stat
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relayrl.common.pb.inference_pb2 import CHECKSUM_ALGORITHM_XXH3_128
from relayrl.common.weights import checksum
from relayrl.config.publication import PublicationConfig, WeightTransport
from relayrl.launcher import local_publication
from relayrl.trainer.transports import GrpcStreamTransport, SharedMemoryTransport, make_transport
from relayrl.trainer.weight_files import write_mapped


def test_auto_is_shared_memory_under_relayrl_run_and_an_explicit_choice_stands() -> None:
    auto = PublicationConfig()

    assert auto.transport is WeightTransport.AUTO  # the default
    assert local_publication(auto).transport is WeightTransport.SHARED_MEMORY
    for kind in (WeightTransport.GRPC_STREAM, WeightTransport.SHARED_PATH):
        assert local_publication(replace(auto, transport=kind)).transport is kind


def test_auto_left_unresolved_by_a_service_started_on_its_own_streams_over_grpc(tmp_path: Path) -> None:
    assert isinstance(make_transport(WeightTransport.AUTO, 4096, tmp_path), GrpcStreamTransport)
    assert isinstance(make_transport(WeightTransport.SHARED_MEMORY, 4096, tmp_path), SharedMemoryTransport)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mapped_file_loads_as_safetensors_with_the_checksum_inference_recomputes(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "b.weight": torch.randn(3, 5, generator=g).to(dtype),
        "a.bias": torch.randn(7, generator=g).to(dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
    }
    path = tmp_path / "v000000001.shm.safetensors"

    m = write_mapped(tensors, 1, [[1, 2, 3]], path)

    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    assert all(loaded[k].dtype == dtype and torch.equal(loaded[k], v) for k, v in tensors.items())  # bit-exact
    assert m.checksum_algorithm == CHECKSUM_ALGORITHM_XXH3_128  # same host, integrity only: the fast hash
    assert m.sha256 == checksum(loaded, m.checksum_algorithm) == checksum(tensors, m.checksum_algorithm)
    assert m.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert (m.version, m.num_tensors, m.path, [list(p.ids) for p in m.probe]) == (1, 3, str(path), [[1, 2, 3]])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
