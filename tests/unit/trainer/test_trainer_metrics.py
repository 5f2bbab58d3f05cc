"""The trainer's Prometheus series at scrape time: the publication gauges stay between probes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest

from relayrl.common.retry import OomBackpressure
from relayrl.trainer.metrics import trainer_metrics
from relayrl.trainer.progress import TrainerProgress
from relayrl.trainer.weight_sync import PushResult


def _scrape(last_push: PushResult | None, last_probe: PushResult | None) -> dict[str, float]:
    publication = SimpleNamespace(
        weight_version=7,
        last_push=last_push,
        last_probe=last_probe,
        publisher=SimpleNamespace(push_retries=2),
        push_failures=lambda: {"10.0.0.1:50051": 0, "10.0.0.2:50051": 3},
    )
    trainer: Any = SimpleNamespace(
        progress=TrainerProgress(step=3),
        publication=publication,
        checkpoints=SimpleNamespace(last_step=0),
        redis_backpressure=OomBackpressure("t"),
    )
    text = generate_latest(trainer_metrics(trainer)).decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def test_push_confirmed_without_a_probe_keeps_the_last_probes_gauges_and_reports_its_own_duration() -> None:
    probed = PushResult(version=5, bytes_sent=100, seconds=0.5, probe_max_diff=2e-6, served_verified=True)
    confirmed = PushResult(version=7, bytes_sent=100, seconds=0.1, probe_max_diff=None, served_verified=True)

    series = _scrape(last_push=confirmed, last_probe=probed)

    assert series["relayrl_trainer_weight_sync_seconds"] == 0.1  # the last publication, not the last probed one
    assert series["relayrl_trainer_probe_max_abs_diff"] == 2e-6
    assert series["relayrl_trainer_probe_weight_version"] == 5


def test_no_publication_yet_exports_no_publication_gauges() -> None:
    series = _scrape(last_push=None, last_probe=None)

    assert "relayrl_trainer_weight_sync_seconds" not in series
    assert "relayrl_trainer_probe_max_abs_diff" not in series
    assert series["relayrl_trainer_step"] == 3
    assert series["relayrl_trainer_redis_oom_retries_total"] == 0 and series["relayrl_trainer_redis_full"] == 0
    assert series["relayrl_trainer_weight_push_retries_total"] == 2
    assert series['relayrl_trainer_weight_push_failures_total{replica="10.0.0.2:50051"}'] == 3
