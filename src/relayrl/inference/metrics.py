"""Prometheus series of the inference service (one registry per service instance)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from relayrl.inference.engine import EngineStats


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], version: Callable[[], int]) -> None:
        self._stats = stats
        self._version = version

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        yield GaugeMetricFamily("relayrl_inference_weight_version", "Weight version served now.", value=self._version())
        yield GaugeMetricFamily(
            "relayrl_inference_sequences_running", "Sequences in the running batch.", value=s.running_sequences
        )
        yield GaugeMetricFamily(
            "relayrl_inference_requests_queued", "Requests waiting to join the batch.", value=s.queued_requests
        )
        yield CounterMetricFamily(
            "relayrl_inference_cancelled_sequences",
            "Sequences freed because their request was cancelled (e.g. a streaming client went away).",
            value=s.cancelled_sequences,
        )


class InferenceMetrics:
    def __init__(self, stats: Callable[[], EngineStats], version: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("relayrl_inference_requests", "Generation requests answered.", ["api"], registry=r)
        self.request_errors = Counter(
            "relayrl_inference_request_errors", "Generation requests refused or failed.", ["api", "code"], registry=r
        )
        self.tokens = Counter("relayrl_inference_generated_tokens", "Tokens generated.", registry=r)
        self.latency = Histogram(
            "relayrl_inference_request_seconds",
            "Latency of a generation request.",
            ["api"],
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.weight_updates = Counter(
            "relayrl_inference_weight_updates", "Weight updates by result.", ["result"], registry=r
        )
        self.weight_update_seconds = Histogram(
            "relayrl_inference_weight_update_seconds",
            "Receive + validate + swap + probe time of a weight update.",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.weight_update_bytes = Counter(
            "relayrl_inference_weight_update_bytes",
            "Bytes of weight updates received (streamed or read from the shared path).",
            registry=r,
        )
        r.register(_EngineCollector(stats, version))
