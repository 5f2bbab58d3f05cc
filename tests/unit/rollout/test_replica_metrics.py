"""Rollout's Prometheus series per inference replica: routed or not, samples in flight, served version, from the
pool's own state (relayrl.client.inference_pool.replica_counts)."""

from __future__ import annotations

from prometheus_client import generate_latest

from relayrl.client.inference_pool import InferencePool, replica_counts
from relayrl.common.pb.rollout_pb2 import RolloutStatus
from relayrl.rollout.metrics import rollout_metrics


async def test_each_replica_has_its_routable_load_and_version_series_labelled_by_address() -> None:
    async with InferencePool(["10.0.0.1:50051", "10.0.0.2:50051"]) as pool:
        a, b = pool.replicas
        a.in_flight, a.version = 16, 7
        b.routable = False
        status = RolloutStatus(**replica_counts(pool))

    text = generate_latest(rollout_metrics(lambda: status)).decode()

    assert status.inference_replicas_routable == 1 and status.inference_replicas == 2
    assert 'relayrl_rollout_inference_replica_routable{replica="10.0.0.1:50051"} 1.0' in text
    assert 'relayrl_rollout_inference_replica_routable{replica="10.0.0.2:50051"} 0.0' in text
    assert 'relayrl_rollout_inference_replica_samples_in_flight{replica="10.0.0.1:50051"} 16.0' in text
    assert 'relayrl_rollout_inference_replica_weight_version{replica="10.0.0.1:50051"} 7.0' in text
    assert 'relayrl_rollout_inference_replica_weight_version{replica="10.0.0.2:50051"} -1.0' in text
