"""Prometheus series of the rollout service, read from its status at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from relayrl.common.pb.rollout_pb2 import RolloutStatus


class _StatusCollector(Collector):
    def __init__(self, status: Callable[[], RolloutStatus]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        s = self._status()
        yield CounterMetricFamily(
            "relayrl_rollout_groups_produced", "Groups appended to the stream by this process.", value=s.groups_produced
        )
        yield CounterMetricFamily(
            "relayrl_rollout_episodes_produced",
            "Episodes appended to the stream by this process.",
            value=s.episodes_produced,
        )
        yield CounterMetricFamily(
            "relayrl_rollout_group_failures", "Failed group attempts (retried or skipped).", value=s.groups_failed
        )
        yield GaugeMetricFamily(
            "relayrl_rollout_groups_running", "Groups being generated or scored.", value=s.groups_running
        )
        yield GaugeMetricFamily(
            "relayrl_rollout_paused", "1 while generation is paused by an operator.", value=int(s.paused)
        )
        yield CounterMetricFamily(
            "relayrl_rollout_redis_oom_retries",
            "Appends refused by a full Redis (maxmemory, noeviction) and retried after a back-off.",
            value=s.redis_oom_retries,
        )
        yield GaugeMetricFamily(
            "relayrl_rollout_append_blocked",
            "1 while an append waits for Redis memory (no new group is admitted).",
            value=int(s.append_blocked),
        )
        yield CounterMetricFamily(
            "relayrl_rollout_episode_turns", "Model turns of the episodes produced.", value=s.episode_turns
        )
        yield CounterMetricFamily(
            "relayrl_rollout_tool_calls", "Tool calls of the episodes produced.", value=s.tool_calls
        )
        yield CounterMetricFamily(
            "relayrl_rollout_tool_errors",
            "Failed tool calls (unknown tool, bad arguments, an error or a timeout) of the episodes produced.",
            value=s.tool_errors,
        )
        ends = CounterMetricFamily(
            "relayrl_rollout_episode_ends", "Episodes produced, by how they ended.", labels=["end"]
        )
        for end, n in sorted(s.episode_ends.items()):
            ends.add_metric([end], n)
        yield ends
        yield CounterMetricFamily(
            "relayrl_rollout_generations_regenerated",
            "Generation calls made again on another inference replica after one failed them.",
            value=s.generations_regenerated,
        )
        yield GaugeMetricFamily(
            "relayrl_rollout_inference_replicas_routable",
            "Inference replicas rollout routes generation to now.",
            value=s.inference_replicas_routable,
        )
        yield from _replica_series(s)
        yield GaugeMetricFamily(
            "relayrl_rollout_trainer_weight_version",
            "Trainer weight version the admission control last saw.",
            value=s.trainer_version,
        )


def _replica_series(s: RolloutStatus) -> Iterator[Metric]:
    """One series per inference replica (label ``replica``: its address), with several replicas."""
    routable = GaugeMetricFamily(
        "relayrl_rollout_inference_replica_routable",
        "1 while rollout routes generation to this inference replica (it answers, serves a current version and its "
        "last weight push did not fail).",
        labels=["replica"],
    )
    in_flight = GaugeMetricFamily(
        "relayrl_rollout_inference_replica_samples_in_flight",
        "Samples of rollout's calls in flight on this inference replica (its load as routing sees it).",
        labels=["replica"],
    )
    version = GaugeMetricFamily(
        "relayrl_rollout_inference_replica_weight_version",
        "Weight version this inference replica served at rollout's last check (-1: not asked yet).",
        labels=["replica"],
    )
    for r in s.inference_replica_states:
        routable.add_metric([r.address], float(r.routable and not r.behind))
        in_flight.add_metric([r.address], r.samples_in_flight)
        version.add_metric([r.address], r.weight_version)
    yield from (routable, in_flight, version)


def rollout_metrics(status: Callable[[], RolloutStatus]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_StatusCollector(status))
    return registry
