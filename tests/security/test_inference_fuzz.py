"""Fuzzing what inference accepts from the network: weight-update chunks and manifests, probes, gRPC generation
requests and OpenAI REST bodies. Whatever arrives, the only outcomes are acceptance or the validator's own
refusal (WeightUpdateError, ValueError, a 4xx with an OpenAI-shaped error), never another exception or a 500."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.probe import check_probe
from relayrl.common.weights import (
    TensorSpec,
    WeightAssembler,
    WeightUpdateError,
    check_finite,
    dtype_name,
    iter_update_messages,
)
from relayrl.config.control import ControlConfig
from relayrl.config.inference import MAX_TEMPERATURE, MIN_TEMPERATURE, InferenceConfig
from relayrl.config.model import ModelConfig
from relayrl.inference.http_app import create_app
from relayrl.inference.native import NativeEngine
from relayrl.inference.server_convert import generation_input
from relayrl.inference.serving import InferenceService

pytestmark = pytest.mark.security
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]
names = st.sampled_from(["a", "b.weight", "c"])
specs = st.dictionaries(
    names,
    st.builds(TensorSpec, st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=3).map(tuple)),
    min_size=1,
)
dtype_names = st.one_of(
    st.sampled_from([dtype_name(d) for d in DTYPES]),
    st.sampled_from(["float", "Tensor", "", "__class__", "complex64"]),
    st.text(max_size=8),
)
chunks = st.builds(
    pb.TensorChunk,
    name=st.one_of(names, st.text(max_size=6)),
    dtype=dtype_names,
    shape=st.lists(st.integers(0, 5), max_size=4),
    offset=st.integers(0, 80),
    total_bytes=st.integers(0, 160),
    data=st.binary(max_size=80),
)
manifests = st.builds(
    pb.WeightManifest,
    version=st.integers(0, 2**63 - 1),
    num_tensors=st.integers(0, 4),
    total_bytes=st.integers(0, 200),
    sha256=st.text(max_size=64),
)


@FUZZ
@given(expected=specs, received=st.lists(chunks, max_size=12), manifest=manifests)
def test_arbitrary_chunks_and_manifest_only_ever_raise_weight_update_error(
    expected: dict[str, TensorSpec], received: list[pb.TensorChunk], manifest: pb.WeightManifest
) -> None:
    assembler = WeightAssembler(expected)
    try:
        for chunk in received:
            assembler.add(chunk)
        tensors = assembler.finish(manifest)
    except WeightUpdateError:
        return
    assert {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()} == {
        k: (s.dtype, s.shape) for k, s in expected.items()
    }


def _random_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(spec.dtype).reshape(spec.shape) if spec.nbytes else torch.empty(spec.shape, dtype=spec.dtype)


@FUZZ
@given(
    expected=specs,
    chunk_bytes=st.integers(1, 40),
    seed=st.integers(0, 1000),
    drop=st.one_of(st.none(), st.integers(0, 50)),
)
def test_a_sent_update_is_assembled_bit_exactly_and_a_dropped_message_is_refused(
    expected: dict[str, TensorSpec], chunk_bytes: int, seed: int, drop: int | None
) -> None:
    tensors = {name: _random_tensor(spec, seed + i) for i, (name, spec) in enumerate(sorted(expected.items()))}
    messages = list(iter_update_messages(tensors, 1, chunk_bytes=chunk_bytes))
    dropped = drop is not None and drop < len(messages) - 1 and messages[drop].chunk.data != b""
    if dropped:
        del messages[drop]  # type: ignore[arg-type]
    assembler = WeightAssembler(expected)

    def assemble() -> dict[str, torch.Tensor]:
        for m in messages[:-1]:
            assembler.add(m.chunk)
        return assembler.finish(messages[-1].manifest)

    if dropped:
        with pytest.raises(WeightUpdateError):
            assemble()
    else:
        got = assemble()
        # bit-exact: bytes compared, so NaN payloads of random float bytes compare equal too
        assert all(got[k].view(-1).view(torch.uint8).equal(t.reshape(-1).view(torch.uint8)) for k, t in tensors.items())


@FUZZ
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    values=st.lists(
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([6e4, 3e38, -3e38])),
        min_size=1,
        max_size=40,
    ),
)
def test_check_finite_refuses_exactly_the_tensors_holding_nan_or_inf(dtype: torch.dtype, values: list[float]) -> None:
    t = torch.tensor(values, dtype=torch.float64).to(dtype)  # values beyond the dtype's range become inf
    finite = bool(torch.isfinite(t).all())  # huge finite values whose sum overflows must still pass

    try:
        check_finite({"w": t})
    except WeightUpdateError:
        assert not finite
    else:
        assert finite


@FUZZ
@given(
    sequences=st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20), max_size=6),
    vocab=st.integers(1, 100),
    max_length=st.integers(1, 30),
    max_tokens=st.integers(2, 60),
)
def test_check_probe_accepts_exactly_in_range_probes_and_otherwise_raises_value_error(
    sequences: list[list[int]], vocab: int, max_length: int, max_tokens: int
) -> None:
    valid = (
        bool(sequences)
        and all(2 <= len(s) <= max_length for s in sequences)
        and sum(map(len, sequences)) <= max_tokens
        and all(0 <= t < vocab for s in sequences for t in s)
    )
    try:
        check_probe(sequences, vocab, max_length, max_tokens)
    except ValueError:
        assert not valid
    else:
        assert valid


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path) -> Iterator[InferenceService]:
    """A real native engine with small limits, so that every accepted request is cheap to run."""
    defaults = InferenceConfig()
    cfg = InferenceConfig(
        max_prompt_tokens=32,
        max_prompt_chars=256,
        max_new_tokens_limit=3,
        max_samples_per_request=3,
        http=replace(defaults.http, host="127.0.0.1", port=0),
    )
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = NativeEngine(
        load_model(ModelConfig(path=tiny_model_dir)), tokenizer, torch.device("cpu"), max_batch_sequences=8
    )
    yield InferenceService(
        cfg, engine, tokenizer, str(tiny_model_dir), weights_token=ControlConfig().effective_weights_token()
    )
    engine.close()


floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
sampling = st.builds(
    pb.SamplingParams,
    n=st.integers(0, 5),
    temperature=floats,
    top_p=floats,
    top_k=st.integers(0, 2**32 - 1),
    max_new_tokens=st.integers(0, 5),
    stop=st.lists(st.text(max_size=3), max_size=2),
    stop_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    ignore_eos=st.booleans(),
)
prompts = st.one_of(
    st.builds(lambda t: {"prompt_text": t}, st.text(max_size=300)),
    st.builds(
        lambda ids: {"prompt_token_ids": pb.TokenIds(ids=ids)}, st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40)
    ),
    st.just({}),
)


@FUZZ
@given(prompt=prompts, params=sampling)
def test_grpc_generate_request_is_either_checked_or_refused_with_value_error(
    service: InferenceService, prompt: dict[str, Any], params: pb.SamplingParams
) -> None:
    request = pb.GenerateRequest(sampling=params, **prompt)
    try:
        inp = asyncio.run(generation_input(service, request))
    except ValueError:
        return
    vocab = service.engine.vocab_size
    assert 1 <= len(inp.prompt_ids) <= service.cfg.max_prompt_tokens
    assert all(0 <= t < vocab for t in inp.prompt_ids) and 1 <= inp.n <= service.cfg.max_samples_per_request
    assert MIN_TEMPERATURE <= inp.temperature <= MAX_TEMPERATURE and 0 < inp.top_p <= 1  # finite, bounded
    assert 1 <= inp.max_new_tokens <= 3 and 0 <= inp.top_k <= vocab


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
KEYS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "stop_token_ids",
    "seed",
    "ignore_eos",
    "stream",
    "logprobs",
    "top_logprobs",
    "echo",
    "user",
]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "robot"]), "content": json_values})
field_values = st.one_of(
    json_values, st.integers(-3, 40), st.lists(st.integers(-3, 300), max_size=5), st.lists(message, max_size=2)
)
bodies = st.one_of(json_values, st.dictionaries(st.sampled_from(KEYS), field_values, max_size=8))


@FUZZ
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
def test_rest_body_is_answered_or_refused_with_an_openai_error_never_500(
    service: InferenceService, route: str, body: Any
) -> None:
    with TestClient(create_app(service), raise_server_exceptions=False) as client:
        response = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})

    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_rest_seed_beyond_what_a_generator_takes_is_a_400_naming_the_seed(service: InferenceService, seed: int) -> None:
    with TestClient(create_app(service), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"prompt": "1+2=", "max_tokens": 2, "seed": seed})

    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "seed"
    assert error["message"].startswith(f"seed={seed}: must be in")
