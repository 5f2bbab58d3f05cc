"""Prometheus series of the trainer (rank 0), read from the trainer's state at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from relayrl.common.books import counters

if TYPE_CHECKING:
    from relayrl.trainer.runtime import Trainer


class _TrainerCollector(Collector):
    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def collect(self) -> Iterator[Metric]:
        yield from self._progress()
        yield from self._redis()
        yield from self._publication()

    def _progress(self) -> Iterator[Metric]:
        """Steps, the run's books, rewards and staleness."""
        t = self._trainer
        s, publication = t.progress, t.publication
        yield GaugeMetricFamily("relayrl_trainer_step", "Optimizer steps done.", value=s.step)
        yield GaugeMetricFamily(
            "relayrl_trainer_weight_version",
            "Weight version of the trainer's latest publication.",
            value=publication.weight_version,
        )
        for name, help_text in counters():  # the run's books (relayrl.common.books)
            yield CounterMetricFamily(f"relayrl_trainer_{name}", help_text, value=getattr(s, name))
        yield GaugeMetricFamily(
            "relayrl_trainer_last_checkpoint_step",
            "Step of the newest durable checkpoint.",
            value=t.checkpoints.last_step,
        )
        if s.last_reward_mean is not None:
            yield GaugeMetricFamily(
                "relayrl_trainer_reward_mean", "Mean reward of the last step's episodes.", value=s.last_reward_mean
            )
        counts = sorted(s.staleness_counts.items())
        buckets, total = [], 0
        for lag, count in counts:
            total += count
            buckets.append((str(float(lag)), float(total)))
        buckets.append(("+Inf", float(total)))
        yield HistogramMetricFamily(
            "relayrl_trainer_sample_staleness_steps",
            "Staleness of trained samples in optimizer steps.",
            buckets=buckets,
            sum_value=float(sum(lag * c for lag, c in counts)),
        )

    def _redis(self) -> Iterator[Metric]:
        """A full Redis's backpressure and the stream's queue."""
        t = self._trainer
        s = t.progress
        oom = t.redis_backpressure
        yield CounterMetricFamily(
            "relayrl_trainer_redis_oom_retries",
            "Writes refused by a full Redis (maxmemory, noeviction) and retried after a back-off.",
            value=oom.retries,
        )
        yield GaugeMetricFamily(
            "relayrl_trainer_redis_full",
            "1 while a write waits on a full Redis (the trainer neither steps nor publishes meanwhile).",
            value=int(oom.full),
        )
        lag, pending = s.queue_depth
        if lag is not None:
            yield GaugeMetricFamily(
                "relayrl_trainer_queue_lag",
                "Stream entries not yet delivered to the trainer's consumer group (at the last step).",
                value=lag,
            )
        yield GaugeMetricFamily(
            "relayrl_trainer_queue_pending",
            "Stream entries delivered but not yet acknowledged (their effect is not yet in a durable checkpoint).",
            value=pending,
        )

    def _publication(self) -> Iterator[Metric]:
        """Weight pushes and the probe."""
        publication = self._trainer.publication
        yield CounterMetricFamily(
            "relayrl_trainer_weight_push_retries",
            "Weight pushes sent again after inference "
            "refused one as busy (RESOURCE_EXHAUSTED) or could not be reached.",
            value=publication.publisher.push_retries,
        )
        failures = CounterMetricFamily(
            "relayrl_trainer_weight_push_failures",
            "Weight pushes to this inference replica that failed or did not answer in time (it was behind after each).",
            labels=["replica"],
        )
        for address, n in publication.push_failures().items():
            failures.add_metric([address], n)
        yield failures
        push = publication.last_push
        if push is not None:  # every publication that landed was verified (probe or served-weights check)
            yield GaugeMetricFamily(
                "relayrl_trainer_weight_sync_seconds",
                "Duration of the last weight publication (snapshot, transfer, swap, probe).",
                value=push.seconds,
            )
            yield GaugeMetricFamily(
                "relayrl_trainer_weight_sync_bytes", "Bytes of the last weight publication.", value=push.bytes_sent
            )
        probed = publication.last_probe
        if probed is not None and probed.probe_max_diff is not None:  # stays between probes (probe_every)
            yield GaugeMetricFamily(
                "relayrl_trainer_probe_max_abs_diff",
                "Largest |logprob difference| between trainer and inference on the last probe.",
                value=probed.probe_max_diff,
            )
            yield GaugeMetricFamily(
                "relayrl_trainer_probe_weight_version", "Weight version of the last probe.", value=probed.version
            )


def trainer_metrics(trainer: Trainer) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_TrainerCollector(trainer))
    return registry
