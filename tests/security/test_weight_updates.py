"""Attacks on and faults in weight updates: a malformed probe, a failing swap, non-finite weights, idle or slow
streams holding the weights port, and pushes to the wrong port. In every refused case the old weights and version
keep serving and the status code is deliberate (never UNKNOWN)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import grpc
import pytest
import torch

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.weights import iter_update_messages, model_tensors
from relayrl.config.endpoints import server_config
from relayrl.config.inference import InferenceConfig
from relayrl.config.typed import ConfigError
from relayrl.inference.serving import InferenceService
from tests.conftest import WEIGHTS_TOKEN
from tests.integration.helpers import inference_server

AUTH = (("authorization", f"Bearer {WEIGHTS_TOKEN}"),)  # the weights token: what the trainer sends
pytestmark = pytest.mark.security
Tensors = dict[str, torch.Tensor]


def _snapshot(service: InferenceService) -> Tensors:
    return {k: v.detach().clone() for k, v in model_tensors(service.engine.model).items()}  # type: ignore[attr-defined]


def _perturbed(service: InferenceService, delta: float = 0.5) -> Tensors:
    return {k: v + delta for k, v in _snapshot(service).items()}


def _unchanged(service: InferenceService, before: Tensors) -> bool:
    # exact: refused updates must not touch a single bit of the served weights
    return all(torch.equal(v, before[k]) for k, v in model_tensors(service.engine.model).items())  # type: ignore[attr-defined]


async def _stream(messages: Iterable[pb.WeightUpdateMessage]) -> AsyncIterator[pb.WeightUpdateMessage]:
    for m in messages:
        yield m


async def _push(
    target: str, messages: Iterable[pb.WeightUpdateMessage], timeout: float = 30
) -> pb.UpdateWeightsResponse:
    async with insecure_channel(target) as channel:
        response: pb.UpdateWeightsResponse = await pb_grpc.InferenceServiceStub(channel).UpdateWeights(
            _stream(messages), timeout=timeout, metadata=AUTH
        )
        return response


async def _refusal(target: str, messages: Iterable[pb.WeightUpdateMessage]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _push(target, messages)
    return err.value.code(), err.value.details() or ""


async def _greedy_tokens(target: str) -> list[int]:
    """A seeded generation: the same weights give the same tokens."""
    request = pb.GenerateRequest(prompt_text="1+2=", sampling=pb.SamplingParams(n=1, max_new_tokens=8, seed=7))
    async with insecure_channel(target) as channel:
        response = await pb_grpc.InferenceServiceStub(channel).Generate(request, timeout=30)
    return list(response.samples[0].token_ids)


async def _served_version(target: str) -> int:
    async with insecure_channel(target) as channel:
        status = await pb_grpc.InferenceServiceStub(channel).GetStatus(pb.GetInferenceStatusRequest(), timeout=30)
    return int(status.weight_version)


@pytest.mark.parametrize("kind", ["id_past_the_vocabulary", "negative_id", "one_token", "longer_than_the_context"])
async def test_update_with_a_malformed_probe_is_invalid_argument_and_the_old_weights_and_version_keep_serving(
    tiny_model_dir: Path, kind: str
) -> None:
    async def go() -> tuple[grpc.StatusCode, int, bool, list[int], list[int]]:
        async with inference_server(tiny_model_dir) as (target, service):
            vocab, context = service.engine.vocab_size, service.engine.context_length
            probe = {
                "id_past_the_vocabulary": [[1, 2, vocab]],
                "negative_id": [[1, -1, 2]],
                "one_token": [[3]],
                "longer_than_the_context": [[1] * (context + 1)],
            }[kind]
            before, tokens_before = _snapshot(service), await _greedy_tokens(target)

            code, _ = await _refusal(
                service.weights_target, iter_update_messages(_perturbed(service), 1, chunk_bytes=1 << 16, probe=probe)
            )

            return (
                code,
                await _served_version(target),
                _unchanged(service, before),
                tokens_before,
                await _greedy_tokens(target),
            )

    code, version, unchanged, tokens_before, tokens_after = await go()

    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert version == 0 and unchanged
    assert tokens_after == tokens_before


async def test_swap_whose_probe_scoring_fails_restores_the_old_weights_and_version_and_is_failed_precondition(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import relayrl.inference.native as native

    def failing_probe(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("injected fault while scoring the probe")

    async def go() -> tuple[grpc.StatusCode, int, bool, bool, int]:
        async with inference_server(tiny_model_dir) as (target, service):
            before, tokens_before = _snapshot(service), await _greedy_tokens(target)
            new = _perturbed(service)
            monkeypatch.setattr(native, "probe_logprobs", failing_probe)

            code, _ = await _refusal(service.weights_target, iter_update_messages(new, 1, probe=[[1, 2, 3]]))

            version, unchanged = await _served_version(target), _unchanged(service, before)
            same_tokens = await _greedy_tokens(target) == tokens_before
            monkeypatch.undo()  # the fault is gone: the same update now lands
            applied = await _push(service.weights_target, iter_update_messages(new, 1, probe=[[1, 2, 3]]))
            return code, version, unchanged, same_tokens, int(applied.version)

    code, version, unchanged, same_tokens, applied = await go()

    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert version == 0 and unchanged and same_tokens
    assert applied == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
async def test_update_with_non_finite_weights_is_refused_before_the_swap(tiny_model_dir: Path, value: float) -> None:
    async def go() -> tuple[grpc.StatusCode, str, int, bool]:
        async with inference_server(tiny_model_dir) as (target, service):
            before = _snapshot(service)
            new = _perturbed(service)
            next(iter(new.values())).view(-1)[3] = value

            code, details = await _refusal(service.weights_target, iter_update_messages(new, 1))

            return code, details, await _served_version(target), _unchanged(service, before)

    code, details, version, unchanged = await go()

    assert code is grpc.StatusCode.INVALID_ARGUMENT and "non-finite" in details
    assert version == 0 and unchanged


async def test_update_refused_at_its_first_chunk_reaches_the_pusher_as_invalid_argument_never_internal(
    tiny_model_dir: Path,
) -> None:
    """A refusal while the pusher still writes: grpc.aio turned the pusher's next write into INTERNAL and hid the
    refusal (grpc/grpc#36066). The server now reads what is left of a refused stream before it answers."""
    from relayrl.client import InferenceClient

    async with (
        inference_server(tiny_model_dir) as (_, service),
        InferenceClient(service.weights_target, token=WEIGHTS_TOKEN) as client,
    ):
        messages = list(iter_update_messages(_perturbed(service), 1, chunk_bytes=1 << 14))
        bad = pb.WeightUpdateMessage()
        bad.CopyFrom(messages[0])
        bad.chunk.name = "no.such.parameter"  # refused as it arrives, before the rest is read
        codes = []
        for _ in range(20):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.update_weights([bad, *messages], 1, 30, attempts=1)
            codes.append(err.value.code().name)
        assert service.engine.version == 0

    assert set(codes) == {"INVALID_ARGUMENT"}, sorted(set(codes))


@pytest.mark.parametrize("sent_first", [0, 1])
async def test_idle_weight_stream_is_aborted_and_frees_the_only_slot_for_a_real_push(
    tiny_model_dir: Path, sent_first: int
) -> None:
    async def go() -> tuple[grpc.StatusCode, str, int, int]:
        async with (
            inference_server(
                tiny_model_dir, weights_limits={"max_authenticated_rpcs": 1}, weights_idle_timeout_s=0.2
            ) as (_, service),
            insecure_channel(service.weights_target) as channel,
        ):
            messages = list(iter_update_messages(_perturbed(service), 1, chunk_bytes=1 << 12))
            never = asyncio.Event()  # the idle sender sends ``sent_first`` messages, then nothing

            async def idle() -> AsyncIterator[pb.WeightUpdateMessage]:
                for m in messages[:sent_first]:
                    yield m
                await never.wait()

            held = pb_grpc.InferenceServiceStub(channel).UpdateWeights(idle(), timeout=60, metadata=AUTH)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(held, 20)  # the server ends it, long before the client's deadline
            never.set()

            response = await _push(service.weights_target, messages)

            return err.value.code(), err.value.details() or "", int(response.version), service.engine.version

    code, details, pushed, served = await go()

    assert code is grpc.StatusCode.DEADLINE_EXCEEDED and "weights_idle_timeout_s" in details
    assert pushed == served == 1


async def test_slow_update_being_received_does_not_block_another_push(tiny_model_dir: Path) -> None:
    """Receiving and assembling happen outside the update lock: a push completes while another stream is still
    sending its chunks (the old code held the lock from the first message on)."""

    async def go() -> tuple[int, int, int]:
        async with (
            inference_server(tiny_model_dir) as (_, service),
            insecure_channel(service.weights_target) as channel,
        ):
            slow_messages = list(iter_update_messages(_perturbed(service, 0.25), 2, chunk_bytes=1 << 12))
            release = asyncio.Event()

            async def slow() -> AsyncIterator[pb.WeightUpdateMessage]:
                yield slow_messages[0]
                await release.wait()
                for m in slow_messages[1:]:
                    yield m

            slow_call = pb_grpc.InferenceServiceStub(channel).UpdateWeights(slow(), timeout=60, metadata=AUTH)
            for _ in range(3000):  # until the server runs it: its handler counts the open weight stream
                if service.weight_streams:
                    break
                await asyncio.sleep(0.01)

            fast = await _push(service.weights_target, iter_update_messages(_perturbed(service, 0.5), 1), timeout=15)
            release.set()
            slow_response = await slow_call

            return int(fast.version), int(slow_response.version), service.engine.version

    fast, slow, served = await go()

    assert fast == 1 and slow == served == 2


async def test_main_port_refuses_weight_updates_naming_the_weights_port_which_accepts_them(
    tiny_model_dir: Path,
) -> None:
    async def go() -> tuple[grpc.StatusCode, str, str, grpc.StatusCode, int, int]:
        async with inference_server(tiny_model_dir) as (target, service):
            new = _perturbed(service)
            code, details = await _refusal(target, iter_update_messages(new, 1))  # with the weights token
            version_after_refusal = await _served_version(target)
            async with insecure_channel(service.weights_target) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as generate:
                    await pb_grpc.InferenceServiceStub(channel).Generate(
                        pb.GenerateRequest(prompt_text="1+2="), timeout=30
                    )

            response = await _push(service.weights_target, iter_update_messages(new, 1))

            return (
                code,
                details,
                service.weights_target,
                generate.value.code(),
                version_after_refusal,
                int(response.version),
            )

    code, details, weights_target, generate_code, refused_version, pushed = await go()

    assert code is grpc.StatusCode.PERMISSION_DENIED and weights_target in details
    assert generate_code is grpc.StatusCode.PERMISSION_DENIED  # generation is not served on the weights port
    assert refused_version == 0 and pushed == 1


def test_launcher_gives_the_weights_server_its_own_free_loopback_port(tmp_path: Path) -> None:
    from relayrl.config import load_run_config
    from relayrl.launcher import Launcher
    from tests.conftest import REPO

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_run_config(
        None,
        [
            f"model.path={model}",
            f"rollout.dataset={REPO / 'examples/data/arithmetic.jsonl'}",
            "inference.weights_server.host=0.0.0.0",
            "inference.weights_server.address=x:1",
        ],
    )

    inference = Launcher(cfg, tmp_path / "run").cfg.inference

    ws = inference.weights_server
    assert ws.host == "127.0.0.1" and ws.port not in (0, 50055, inference.server.port)
    assert ws.target == f"127.0.0.1:{ws.port}"  # what the trainer's publisher is given


def test_weights_server_on_the_main_servers_port_is_a_config_error() -> None:
    cfg = InferenceConfig(server=server_config(50051), weights_server=server_config(50051))

    with pytest.raises(ConfigError) as err:
        cfg.validate()

    assert err.value.field == "weights_server.port"
