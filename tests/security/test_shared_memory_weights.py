"""The same-host (shared_memory) weight transport against a local attacker: a manifest naming a file outside the
weights directory (by ``..`` or through a symlink) is refused, a file changed after the trainer wrote it fails the
checksum, and the trainer never writes through a symlink planted where its file goes. In every refused case the
old weights and version keep serving."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc
import pytest
import torch

from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.weights import TensorSpec, model_tensors, read_shared
from relayrl.config.publication import WeightTransport
from relayrl.inference.serving import InferenceService
from relayrl.trainer.transports import SharedMemoryTransport, make_transport
from relayrl.trainer.weight_files import write_mapped
from tests.integration.helpers import inference_server
from tests.security.test_weight_updates import _refusal

pytestmark = pytest.mark.security


def _new_weights(service: InferenceService) -> dict[str, torch.Tensor]:
    return {k: v.detach() + 0.5 for k, v in model_tensors(service.engine.model).items()}  # type: ignore[attr-defined]


def _served(service: InferenceService) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model_tensors(service.engine.model).items()}  # type: ignore[attr-defined]


def _same(service: InferenceService, before: dict[str, torch.Tensor]) -> bool:
    # exact: a refused update must not touch a single bit of the served weights
    return all(torch.equal(v, before[k]) for k, v in _served(service).items())


@pytest.mark.parametrize("escape", ["dotdot", "symlink"])
async def test_shared_memory_manifest_naming_a_file_outside_the_weights_directory_is_refused(
    tiny_model_dir: Path, tmp_path: Path, escape: str
) -> None:
    async def go() -> tuple[grpc.StatusCode, str, bool, int]:
        weights_dir = tmp_path / "weights"
        weights_dir.mkdir()
        async with inference_server(tiny_model_dir, weights_dir=weights_dir) as (_, service):
            before = _served(service)
            outside = tmp_path / "elsewhere.shm.safetensors"  # a valid update, checksum and all, in the wrong place
            m = write_mapped(_new_weights(service), 1, [], outside)
            if escape == "dotdot":
                m.path = str(weights_dir / ".." / outside.name)
            else:
                link = weights_dir / "v000000001.shm.safetensors"
                link.symlink_to(outside)
                m.path = str(link)
            code, details = await _refusal(service.weights_target, [pb.WeightUpdateMessage(manifest=m)])
            return code, details, _same(service, before), service.engine.version

    code, details, unchanged, version = await go()

    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the weights directory" in details
    assert unchanged and version == 0


async def test_shared_memory_file_modified_after_the_trainer_wrote_it_fails_the_checksum(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    async def go() -> tuple[grpc.StatusCode, str, bool, int]:
        weights_dir = tmp_path / "weights"
        async with inference_server(tiny_model_dir, weights_dir=weights_dir) as (_, service):
            before = _served(service)
            transport = make_transport(WeightTransport.SHARED_MEMORY, 16384, weights_dir)
            [message] = transport.prepare(_new_weights(service), 1, [])
            path = Path(message.manifest.path)
            with open(path, "r+b") as f:  # one byte of the last tensor's data, after the trainer hashed it
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
            code, details = await _refusal(service.weights_target, [message])
            return code, details, _same(service, before), service.engine.version

    code, details, unchanged, version = await go()

    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "checksum" in details
    assert unchanged and version == 0


@pytest.mark.parametrize("planted", ["v000000001.shm.safetensors.tmp", "v000000001.shm.safetensors"])
def test_trainer_never_writes_through_a_symlink_planted_where_its_weights_file_goes(
    tmp_path: Path, planted: str
) -> None:
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (weights_dir / planted).symlink_to(victim)
    transport = SharedMemoryTransport(weights_dir)

    [message] = transport.prepare({"w": torch.ones(4, 4)}, 1, [])

    assert victim.read_text() == "precious"
    info = os.lstat(message.manifest.path)
    assert stat.S_ISREG(info.st_mode)  # a file of the trainer's own, not the planted link
    assert stat.S_IMODE(info.st_mode) == 0o600  # readable by the trainer's user (and inference, same user) only


def test_weights_read_from_a_shared_file_do_not_follow_a_change_to_the_file_after_validation(tmp_path: Path) -> None:
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    m = write_mapped({"w": torch.zeros(64)}, 1, [], weights_dir / "v000000001.shm.safetensors")
    tensors = read_shared(m, weights_dir, {"w": TensorSpec(torch.float32, (64,))})  # checksum passed

    with open(m.path, "r+b") as f:  # the file changes between the check and the swap
        f.seek(-4, os.SEEK_END)
        f.write(torch.tensor([1.0]).numpy().tobytes())

    assert torch.equal(tensors["w"], torch.zeros(64))  # exact: what was checked is what gets swapped in
