"""The collective weight transport (trainer.publication.transport: collective): one gloo group per update, formed by
the trainer and the replicas that joined, every tensor broadcast once; each replica checks the manifest's checksum
and the trainer verifies each as for every transport. A replica that is down or cannot take the update misses it
(behind) without holding the others up, and only a holder of the weights token learns the group's name."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from relayrl.common.collective_weights import CollectiveHost, receive, spec_layout
from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.weights import TensorSpec, WeightUpdateError, manifest, parameter_specs
from relayrl.config.model import ModelConfig
from relayrl.config.publication import WeightTransport
from relayrl.inference.server import InferenceService
from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model
from relayrl.trainer.transports import CollectiveTransport, make_transport
from relayrl.trainer.weight_sync import WeightPublisher
from tests.conftest import WEIGHTS_TOKEN
from tests.integration.helpers import inference_server

pytestmark = pytest.mark.integration

TIMEOUT_S = 10.0  # the group's join and broadcast steps: a missed deadline fails the test, never passes it


def _host() -> CollectiveHost:
    return CollectiveHost("127.0.0.1", 0, "gloo", TIMEOUT_S)


def _publisher(model_dir: Path, targets: list[str], tmp_path: Path, timeout_s: float = 30.0) -> WeightPublisher:
    model = load_model(ModelConfig(path=model_dir))
    probe = WeightPublisher.default_probe(model, load_tokenizer(model_dir), sequences=2, tokens=8, seed=0)
    return WeightPublisher(
        model,
        torch.device("cpu"),
        targets,
        make_transport(WeightTransport.COLLECTIVE, 16384, tmp_path / "weights", _host()),
        timeout_s=timeout_s,
        probe=probe,
        probe_tolerance=None,
        token=WEIGHTS_TOKEN,
    )


def _perturb(pub: WeightPublisher, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pub.model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def _serves(service: InferenceService, pub: WeightPublisher) -> bool:
    served = dict(service.engine.model.named_parameters())  # type: ignore[attr-defined]
    return all(torch.equal(served[n], p) for n, p in pub.model.named_parameters())


@contextlib.asynccontextmanager
async def _replicas(*model_dirs: Path) -> AsyncIterator[list[tuple[str, InferenceService]]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(inference_server(d)) for d in model_dirs]


async def test_every_replica_receives_each_version_by_one_broadcast_and_serves_exactly_the_trainers_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    async with _replicas(tiny_model_dir, tiny_model_dir, tiny_model_dir) as replicas:
        pub = _publisher(tiny_model_dir, [s.weights_target for _, s in replicas], tmp_path)
        assert isinstance(pub.transport, CollectiveTransport)
        for version in (1, 2):
            _perturb(pub, version)
            result = await pub.push(pub.snapshot(), version)

            assert result.verified and result.served_verified  # each replica's served-weights check, by checksum
            assert result.probe_max_diff is not None and result.probe_max_diff <= 1e-5  # float32: reduction order
            assert all(s.engine.version == version and _serves(s, pub) for _, s in replicas)
        assert not pub.behind and pub.failed_pushes == dict.fromkeys(pub.targets, 0)
        await pub.close()


async def test_a_replica_that_is_down_or_cannot_take_the_update_misses_it_and_the_others_are_served(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = create_tiny_model(tmp_path / "wider", TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2))
    async with _replicas(tiny_model_dir, other) as ((_, good), (_, wrong)):
        down = "127.0.0.1:1"  # nothing listens: the call fails at once
        # a push to it retries UNAVAILABLE until its deadline: 8 s, so the test is not held up by it
        pub = _publisher(tiny_model_dir, [good.weights_target, wrong.weights_target, down], tmp_path, timeout_s=8.0)
        _perturb(pub, 1)
        result = await pub.push(pub.snapshot(), 1)

        assert result.verified and good.engine.version == 1 and _serves(good, pub)
        assert wrong.engine.version == 0  # its model's layout differs: refused before it joined
        assert pub.behind == {wrong.weights_target, down}
        await pub.close()


async def test_an_update_without_the_weights_token_is_refused_before_its_group_is_joined(
    tiny_model_dir: Path,
) -> None:
    host = _host()
    session = host.session(1, torch.device("cpu"))
    async with inference_server(tiny_model_dir) as (_, service), insecure_channel(service.weights_target) as channel:
        tensors = {k: v.detach() + 1 for k, v in service.engine.model.named_parameters()}  # type: ignore[attr-defined]
        m = manifest(tensors, 1)
        m.collective.CopyFrom(session.join(1, ""))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.InferenceServiceStub(channel).UpdateWeights(
                iter([pb.WeightUpdateMessage(manifest=m)]), timeout=30
            )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not session.store.check(["ready/1"]) and service.engine.version == 0


async def test_a_process_that_does_not_know_the_group_name_receives_nothing_and_holds_nothing_up(
    tiny_model_dir: Path,
) -> None:
    model = load_model(ModelConfig(path=tiny_model_dir))
    specs = parameter_specs(model)
    tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
    host = CollectiveHost("127.0.0.1", 0, "gloo", 2.0)  # the rogue's wait ends in 2 s
    session = host.session(1, torch.device("cpu"))
    join = session.join(1, spec_layout(specs))
    rogue = pb.CollectiveJoin()
    rogue.CopyFrom(join)
    rogue.group = "0" * 32  # the store's address is no secret; the group's name is

    async def receiver() -> dict[str, torch.Tensor]:
        return await asyncio.to_thread(receive, join, specs, torch.device("cpu"))

    got, outsider, _ = await asyncio.gather(
        receiver(),
        asyncio.to_thread(_try, rogue, specs),
        asyncio.to_thread(lambda: (session.gather_members(lambda r: False, lambda t: 1.0), session.broadcast(tensors))),
    )
    assert session.members == [1] and all(torch.equal(got[n], t) for n, t in tensors.items())
    assert isinstance(outsider, WeightUpdateError)  # it waited for members under a name nobody uses, then gave up


def _try(join: pb.CollectiveJoin, specs: dict[str, TensorSpec]) -> BaseException | None:
    try:
        receive(join, specs, torch.device("cpu"))
    except WeightUpdateError as exc:
        return exc
    return None
