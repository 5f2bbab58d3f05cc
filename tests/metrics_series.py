"""The Prometheus series the four services really export, read from their registries (the dashboard and the docs are
checked against them)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from relayrl.common.pb.rollout_pb2 import InferenceReplica, RolloutStatus
from relayrl.common.retry import OomBackpressure
from relayrl.inference.engine import EngineStats
from relayrl.inference.metrics import InferenceMetrics
from relayrl.reward.server import RewardMetrics
from relayrl.rollout.metrics import rollout_metrics
from relayrl.trainer.metrics import trainer_metrics
from relayrl.trainer.progress import TrainerProgress


def exported_series() -> set[str]:
    """Sample names the four services' registries really expose (counters with _total, histograms' parts)."""
    return {s.name for r in _registries() for m in r.collect() for s in m.samples}


def _registries() -> list[CollectorRegistry]:
    """The four services' registries, built from stand-ins holding one value of everything they report."""
    progress = TrainerProgress(last_reward_mean=0.5, queue_depth=(1, 2), staleness_counts={0: 3})
    push = SimpleNamespace(probe_max_diff=0.0, seconds=1.0, bytes_sent=10, version=1)
    publication = SimpleNamespace(
        weight_version=1,
        last_push=push,
        last_probe=push,
        publisher=SimpleNamespace(push_retries=0),
        push_failures=lambda: {"10.0.0.1:50051": 0},
    )
    trainer = SimpleNamespace(
        progress=progress,
        publication=publication,
        checkpoints=SimpleNamespace(last_step=0),
        redis_backpressure=OomBackpressure("trainer"),
    )
    pool = SimpleNamespace(ready_workers=1, busy_workers=0, queued=0)
    return [
        trainer_metrics(trainer),  # type: ignore[arg-type]
        InferenceMetrics(lambda: EngineStats(0, 0, 0, 0), lambda: 1).registry,
        RewardMetrics(pool).registry,  # type: ignore[arg-type]
        rollout_metrics(lambda: RolloutStatus(inference_replica_states=[InferenceReplica(address="10.0.0.1:50051")])),
    ]


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def exported_names() -> set[str]:
    """Every series name a scrape can show: the samples of :func:`exported_series`, and each family's own name with
    its type's suffixes (a labelled family shows none until a label value is used)."""
    registries = _registries()
    families = {(m.name, m.type) for r in registries for m in r.collect()}
    return exported_series() | {n + s for n, kind in families for s in ("", *SUFFIXES.get(kind, ()))}
