"""Protobuf round trips and the chunked weight-update format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relayrl.common.pb import episode_pb2, inference_pb2, reward_pb2
from relayrl.common.weights import (
    TensorSpec,
    WeightAssembler,
    WeightUpdateError,
    checksum,
    iter_update_messages,
    read_shared,
)
from relayrl.trainer.weight_files import write_mapped


def test_episode_round_trip_preserves_every_field() -> None:
    ep = episode_pb2.Episode(
        episode_id="e1",
        prompt_id="p1",
        group_id="g1",
        sample_index=3,
        group_size=8,
        prompt_token_ids=[1, 2],
        completion_token_ids=[3, 4, 5],
        behaviour_logprobs=[-0.5, -1.0, -0.25],
        token_weight_versions=[7, 7, 8],
        loss_mask=[1, 1, 0],
        reward=0.75,
        reward_components={"exact": 1.0},
        finish_reason=1,
        producer_id="r0",
        created_at=1.5,
        enqueued_at=2.5,
        prompt_text="1+1=",
        completion_text="2",
        sampling_temperature=0.7,
    )

    back = episode_pb2.Episode.FromString(ep.SerializeToString())

    assert back == ep
    assert list(back.token_weight_versions) == [7, 7, 8]


def test_generate_request_oneof_and_optional_seed_round_trip() -> None:
    req = inference_pb2.GenerateRequest(
        prompt_token_ids=inference_pb2.TokenIds(ids=[4, 5]),
        sampling=inference_pb2.SamplingParams(n=2, max_new_tokens=3, seed=0),
    )

    back = inference_pb2.GenerateRequest.FromString(req.SerializeToString())

    assert back.WhichOneof("prompt") == "prompt_token_ids"
    assert back.sampling.HasField("seed") and back.sampling.seed == 0
    assert not inference_pb2.SamplingParams().HasField("seed")


def test_score_response_error_status_round_trip() -> None:
    resp = reward_pb2.ScoreResponse(episode_id="e", status=reward_pb2.SCORE_STATUS_ERROR, error="boom")

    back = reward_pb2.ScoreResponse.FromString(resp.SerializeToString())

    assert back.status == reward_pb2.SCORE_STATUS_ERROR and back.error == "boom"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 33, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16)}


def _specs(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in tensors.items()}


def test_weight_update_small_chunks_reassemble_bit_exactly() -> None:
    tensors = _tensors()
    messages = list(iter_update_messages(tensors, version=5, chunk_bytes=1000))
    assembler = WeightAssembler(_specs(tensors))

    for m in messages[:-1]:
        assembler.add(m.chunk)
    out = assembler.finish(messages[-1].manifest)

    assert len(messages) > 10  # 64*33*4 bytes in 1000-byte chunks: the tensor really was split
    assert messages[-1].manifest.version == 5
    for name, t in tensors.items():
        assert torch.equal(out[name], t)  # bytes are copied, so equality is exact


def test_weight_update_unknown_name_is_refused_at_the_chunk() -> None:
    tensors = _tensors()
    assembler = WeightAssembler(_specs({"a.weight": tensors["a.weight"]}))
    chunk = next(m.chunk for m in iter_update_messages(tensors, 1) if m.chunk.name == "b.bias")

    with pytest.raises(WeightUpdateError, match="unknown tensor name"):
        assembler.add(chunk)


def test_weight_update_wrong_shape_is_refused() -> None:
    tensors = _tensors()
    specs = _specs(tensors)
    specs["a.weight"] = TensorSpec(torch.float32, (33, 64))
    assembler = WeightAssembler(specs)

    with pytest.raises(WeightUpdateError, match="shape"):
        for m in iter_update_messages(tensors, 1):
            if m.HasField("chunk"):
                assembler.add(m.chunk)


def test_weight_update_corrupted_bytes_fail_the_checksum() -> None:
    tensors = _tensors()
    messages = list(iter_update_messages(tensors, 1, chunk_bytes=4096))
    first = messages[0].chunk
    first.data = bytes([first.data[0] ^ 1]) + first.data[1:]
    assembler = WeightAssembler(_specs(tensors))
    for m in messages[:-1]:
        assembler.add(m.chunk)

    with pytest.raises(WeightUpdateError, match="checksum"):
        assembler.finish(messages[-1].manifest)


def test_weight_update_missing_tensor_is_refused() -> None:
    tensors = _tensors()
    messages = list(iter_update_messages({"a.weight": tensors["a.weight"]}, 1))
    assembler = WeightAssembler(_specs(tensors))
    for m in messages[:-1]:
        assembler.add(m.chunk)

    with pytest.raises(WeightUpdateError, match="missing"):
        assembler.finish(messages[-1].manifest)


def test_checksum_depends_on_names_and_values() -> None:
    t = _tensors()
    renamed = {"z" + k: v for k, v in t.items()}
    changed = {**t, "a.weight": t["a.weight"] + 1}

    assert len({checksum(t), checksum(renamed), checksum(changed)}) == 3


def test_checksum_algorithms_give_different_digests_of_the_same_tensors_each_sensitive_to_one_bit() -> None:
    t = _tensors()
    flipped = {**t, "a.weight": t["a.weight"].clone()}
    flipped["a.weight"].view(torch.int32)[3, 5] ^= 1  # one bit of one value

    sha, xxh = checksum(t), checksum(t, inference_pb2.CHECKSUM_ALGORITHM_XXH3_128)

    assert (len(sha), len(xxh)) == (64, 32)  # hex of 256 and 128 bits
    assert checksum(t, inference_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED) == sha  # unset means SHA-256
    assert checksum(flipped) != sha
    assert checksum(flipped, inference_pb2.CHECKSUM_ALGORITHM_XXH3_128) != xxh


def test_streamed_manifest_names_sha256_and_one_from_an_older_sender_without_algorithm_is_accepted() -> None:
    tensors = _tensors()
    messages = list(iter_update_messages(tensors, 1))
    old = inference_pb2.WeightManifest()
    old.CopyFrom(messages[-1].manifest)
    old.ClearField("checksum_algorithm")  # as a sender that predates the field
    assembler = WeightAssembler(_specs(tensors))
    for m in messages[:-1]:
        assembler.add(m.chunk)

    out = assembler.finish(old)

    assert messages[-1].manifest.checksum_algorithm == inference_pb2.CHECKSUM_ALGORITHM_SHA256
    assert all(torch.equal(out[k], v) for k, v in tensors.items())


def test_shared_file_is_checked_by_the_manifests_algorithm_and_refused_under_another(tmp_path: Path) -> None:
    tensors = _tensors()
    m = write_mapped(tensors, 1, [], tmp_path / "v000000001.shm.safetensors")
    as_sha256 = inference_pb2.WeightManifest()
    as_sha256.CopyFrom(m)
    as_sha256.checksum_algorithm = inference_pb2.CHECKSUM_ALGORITHM_SHA256  # what a receiver predating XXH3 does
    unknown = inference_pb2.WeightManifest()
    unknown.CopyFrom(m)
    unknown.checksum_algorithm = 99  # type: ignore[assignment]  # a future algorithm this receiver lacks

    out = read_shared(m, tmp_path, _specs(tensors))

    assert m.checksum_algorithm == inference_pb2.CHECKSUM_ALGORITHM_XXH3_128
    assert all(torch.equal(out[k], v) for k, v in tensors.items())
    with pytest.raises(WeightUpdateError, match="checksum mismatch"):
        read_shared(as_sha256, tmp_path, _specs(tensors))
    with pytest.raises(WeightUpdateError, match="unknown checksum algorithm 99"):
        read_shared(unknown, tmp_path, _specs(tensors))
