"""A publication overlapped with the next step: its version is allocated and registered before the push (staleness
exact at once), admission keeps the served step's window while the push is in flight, the push's error surfaces
at settle, and the probe of an in-flight push never runs inside an optimizer step. Real Redis, real gRPC weights
server on port 0, the real tiny model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.common.model import load_model, load_tokenizer
from relayrl.common.probe import WeightVerificationError
from relayrl.common.redis_keys import RedisKeys
from relayrl.common.stream import EpisodeStream
from relayrl.config.model import ModelConfig
from relayrl.config.publication import WeightTransport
from relayrl.inference.serving import InferenceService
from relayrl.trainer import weight_sync
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.publication import VersionPublication
from relayrl.trainer.transports import make_transport
from relayrl.trainer.versions import VersionLineage, VersionSource
from relayrl.trainer.weight_sync import WeightPublisher
from tests.conftest import WEIGHTS_TOKEN, RedisServer
from tests.integration.helpers import inference_server

pytestmark = pytest.mark.integration


@asynccontextmanager
async def _stack(
    model_dir: Path, tmp_path: Path, redis_url: str
) -> AsyncIterator[tuple[VersionPublication, InferenceService]]:
    weights_dir = tmp_path / "weights"
    async with inference_server(model_dir, weights_dir=weights_dir) as (target, service):
        model = load_model(ModelConfig(path=model_dir))
        probe = WeightPublisher.default_probe(model, load_tokenizer(model_dir), sequences=2, tokens=8, seed=0)
        publisher = WeightPublisher(
            model,
            torch.device("cpu"),
            service.weights_target,
            make_transport(WeightTransport.SHARED_MEMORY, 16384, weights_dir),
            30.0,
            probe,
            None,
            token=WEIGHTS_TOKEN,
        )
        client = EpisodeStream.from_url(redis_url, "s", "g").client
        keys = RedisKeys(version_counter="v")
        yield (
            VersionPublication(
                publisher,
                VersionSource(client, keys),
                VersionLineage(client, keys),
                Collectives(None, 10.0),
                target,
                retry_s=5.0,
            ),
            service,
        )


def _gate(service: InferenceService) -> asyncio.Event:
    """Hold every swap until the returned event is set (the push is then in flight)."""
    opened = asyncio.Event()
    apply = service.apply_update

    async def gated(tensors: Any, version: int, probe: Sequence[Sequence[int]]) -> list[float]:
        await opened.wait()
        return await apply(tensors, version, probe)

    service.apply_update = gated  # type: ignore[method-assign]
    return opened


async def test_overlapped_publication_has_its_version_at_once_and_admission_keeps_the_served_steps_window(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    async def go() -> None:
        async with _stack(tiny_model_dir, tmp_path, redis_server.url) as (publication, service):
            first, _ = await publication.publish(0)  # step 0 served and verified
            opened = _gate(service)

            version, _ = await publication.publish(1, wait=False)

            assert publication.publishing and service.engine.version == first  # the push is in flight
            assert await publication.staleness(first) == 1  # measured from the new version at once
            assert publication.admission_step(1) == 0  # rollout keeps the window of the served step
            opened.set()
            await publication.settle()
            assert service.engine.version == version and not publication.publishing
            assert publication.admission_step(1) == 1
            assert publication.last_push is not None and publication.last_push.verified

    await go()


async def test_a_failed_overlapped_push_raises_at_settle(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    async def go() -> None:
        async with _stack(tiny_model_dir, tmp_path, redis_server.url) as (publication, service):
            await publication.publish(0)
            model = service.engine.model  # type: ignore[attr-defined]
            # a reload that leaves the tied output layer behind: the probe must catch it
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in publication.publisher.model.parameters():
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
            await publication.publish(1, wait=False)

            with pytest.raises(WeightVerificationError, match="disagree"):
                await publication.settle()
            assert not publication.publishing

    await go()


async def test_closing_with_a_push_in_flight_stops_it_and_a_later_publication_takes_a_newer_version(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    async def go() -> tuple[int, int, int, bool]:
        async with _stack(tiny_model_dir, tmp_path, redis_server.url) as (publication, service):
            first, _ = await publication.publish(0)
            opened = _gate(service)  # the push stays in flight until the trainer has given it up
            abandoned, _ = await publication.publish(1, wait=False)

            await publication.abandon()
            publishing = publication.publishing  # the push is gone although inference never answered it
            opened.set()  # inference, whatever became of the abandoned call, takes updates again
            later, _ = await publication.publish(2)  # the push lock was released, the counter moved on
            return first, abandoned, later, publishing

    first, abandoned, later, publishing = await go()

    assert first < abandoned < later  # versions are never reused, also around an abandoned push
    assert not publishing


async def test_the_probe_of_an_in_flight_push_never_runs_inside_an_optimizer_step(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    step_entered, probe_started = threading.Event(), threading.Event()
    score = weight_sync.probe_logprobs

    def probe(*args: Any) -> torch.Tensor:
        probe_started.set()
        return score(*args)

    monkeypatch.setattr(weight_sync, "probe_logprobs", probe)

    async def go() -> bool:
        async with _stack(tiny_model_dir, tmp_path, redis_server.url) as (publication, _):
            await publication.publish(0)
            probe_started.clear()
            prepare = publication.publisher.transport.prepare

            def prepare_after_the_step_began(*args: Any) -> Any:
                step_entered.wait(10)  # the optimizer step below holds the model when the probe wants it
                return prepare(*args)

            publication.publisher.transport.prepare = prepare_after_the_step_began  # type: ignore[method-assign]
            await publication.publish(1, wait=False)

            def optimizer_step() -> bool:
                step_entered.set()
                return probe_started.wait(1.0)  # True: the probe ran while this step held the model

            overlapped = await asyncio.to_thread(publication.locked, optimizer_step)
            await publication.settle()
            assert probe_started.is_set()  # it did run, after the step
            return overlapped

    assert await go() is False


async def test_a_version_prepared_while_the_step_computes_is_the_one_its_publication_serves(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    async with _stack(tiny_model_dir, tmp_path, redis_server.url) as (publication, service):
        first, _ = await publication.publish(0)
        allocation = publication.prepare(1)  # as the step starts computing
        stepped, snapshot = await asyncio.to_thread(publication.step_and_snapshot, lambda: "stepped")
        assert allocation is not None
        prepared = await asyncio.shield(allocation)  # a step that outlasts the allocation

        version, _ = await publication.publish(1, snapshot=snapshot)
        latest = await publication.versions.latest()

    assert stepped == "stepped" and snapshot is not None  # rank 0, unsharded: the copy came from the compute thread
    assert version == prepared == latest > first  # nothing allocated at the publication itself
    assert service.engine.version == version
    assert await publication.staleness(first) == 1  # registered with its policy step while the step computed


async def test_a_prepared_version_overtaken_by_a_re_push_is_skipped_and_a_newer_one_is_served(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    async with _stack(tiny_model_dir, tmp_path, redis_server.url) as (publication, service):
        first, _ = await publication.publish(0)
        allocation = publication.prepare(1)
        assert allocation is not None
        skipped = await asyncio.shield(allocation)
        # the watchdog's re-push during the step: a later version, which inference now serves
        repushed = await publication.allocate_and_push(0, first)

        version, _ = await publication.publish(1)  # the prepared version would be refused as stale

    assert first < skipped < repushed < version  # never reused, never below what inference serves
    assert service.engine.version == version


async def test_a_dropped_preparation_skips_its_version(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    async with _stack(tiny_model_dir, tmp_path, redis_server.url) as (publication, _):
        first, _ = await publication.publish(0)
        publication.prepare(1)
        await asyncio.sleep(0)
        await publication.drop_prepared()  # the step was abandoned
        skipped = await publication.versions.latest()

        version, _ = await publication.publish(1)

    assert first <= skipped < version  # the allocation may or may not have happened; either way never reused


async def test_no_copy_is_taken_in_the_step_while_the_previous_push_still_holds_its_own(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    async with _stack(tiny_model_dir, tmp_path, redis_server.url) as (publication, service):
        await publication.publish(0)
        opened = _gate(service)
        await publication.publish(1, wait=False)  # in flight: its copy of the weights is alive

        _, during = await asyncio.to_thread(publication.step_and_snapshot, lambda: None)
        opened.set()
        await publication.settle()
        _, after = await asyncio.to_thread(publication.step_and_snapshot, lambda: None)
        version, _ = await publication.publish(2, wait=False, snapshot=after)
        await publication.settle()

    assert during is None  # one copy beside the model at most, on the model's device
    assert after is not None
    assert service.engine.version == version
