"""Tensors that share one storage (a packed snapshot, a file read at once) are read, hashed and checked per storage:
the results must equal the per-tensor ones exactly, and a bad value anywhere must still be found and named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relayrl.common.tensor_views import byte_views, packed_copy, spans, tensor_bytes
from relayrl.common.weights import TensorSpec, WeightUpdateError, check_finite, read_shared
from relayrl.trainer.weight_files import write_mapped


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randn(2, 2, 2, generator=g),
        "d": torch.zeros(0, 4),
        "e": torch.randn(4, generator=g),
        "f": torch.tensor(2.5),
    }


def test_packed_copy_equals_a_clone_shares_one_buffer_per_dtype_and_is_independent_of_its_source() -> None:
    src = {k: v.clone().requires_grad_(v.is_floating_point() and v.numel() > 0) for k, v in _mixed().items()}

    packed = packed_copy(src)
    with torch.no_grad():
        for v in src.values():
            v.add_(1)  # training moves on: the copy must not

    originals = _mixed()
    assert list(packed) == sorted(src)
    assert all(torch.equal(packed[k], originals[k]) and packed[k].dtype == originals[k].dtype for k in src)
    assert not any(t.requires_grad for t in packed.values())
    f32 = [packed[k] for k in ("a", "c", "e", "f")]
    assert len({t.untyped_storage().data_ptr() for t in f32}) == 1  # one float32 buffer, name order
    assert [t.storage_offset() for t in f32] == [0, 15, 23, 27]


def test_byte_views_of_a_shared_storage_equal_each_tensors_own_bytes() -> None:
    packed = packed_copy(_mixed())
    strided = {"t": torch.arange(12, dtype=torch.float32).view(3, 4).t()}  # not contiguous: the slow path

    views = byte_views({**packed, **strided})

    assert {k: bytes(v) for k, v in views.items()} == {
        k: bytes(tensor_bytes(t)) for k, t in {**packed, **strided}.items()
    }


def test_spans_join_adjacent_tensors_and_keep_gaps_and_strided_tensors_apart() -> None:
    buf = torch.arange(20, dtype=torch.float32)
    a, b, c = buf[0:4], buf[4:10].view(2, 3), buf[12:15]  # a and b adjacent, a gap before c
    strided = torch.arange(6, dtype=torch.float32).view(2, 3).t()

    out = spans([c, b, a, strided])

    assert sorted(t.tolist() if t.dim() == 1 else [-1.0] for t in out) == sorted(
        [[float(i) for i in range(10)], [12.0, 13.0, 14.0], [-1.0]]
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["b", "e"])
def test_check_finite_over_a_file_read_at_once_names_the_tensor_holding_the_bad_value(
    tmp_path: Path, bad: float, where: str
) -> None:
    tensors = {k: v for k, v in _mixed().items() if k != "f"}
    tensors[where] = tensors[where].clone()
    tensors[where][1] = bad
    m = write_mapped(tensors, 1, [], tmp_path / "v000000001.shm.safetensors")
    loaded = read_shared(m, tmp_path, {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in tensors.items()})

    with pytest.raises(WeightUpdateError, match=f"^{where}: holds non-finite"):
        check_finite(loaded)
    loaded[where][1] = 0.0
    check_finite(loaded)  # the same views, now finite: accepted
