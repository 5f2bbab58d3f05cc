"""`relayrl status` finds the replicas behind a balanced target the way the balancing client does: the addresses
of an ``ipv4:`` list, or every address a name resolves to now; a name with one address is one replica."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from relayrl.status import replica_addresses


async def test_an_address_list_is_its_replicas_and_localhost_is_one() -> None:
    assert await replica_addresses("ipv4:10.0.0.5:50052,10.0.0.6:50052") == ["10.0.0.5:50052", "10.0.0.6:50052"]
    assert await replica_addresses("localhost:50052") == ["localhost:50052"]  # ::1 and 127.0.0.1: one service
    assert await replica_addresses("dns:///localhost:50052") == ["dns:///localhost:50052"]
    assert await replica_addresses("no-such-host.invalid:50052") == ["no-such-host.invalid:50052"]


async def test_a_name_that_resolves_to_several_pods_is_one_replica_each(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo

    def headless(host: str, port: int, family: int = 0, type: int = 0, *args: Any) -> Any:
        if host != "rl-relayrl-reward-pods.ml.svc":
            return real(host, port, family, type, *args)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("10.1.0.9", "10.1.0.7", "10.1.0.9")]

    monkeypatch.setattr(socket, "getaddrinfo", headless)

    assert await replica_addresses("dns:///rl-relayrl-reward-pods.ml.svc:50052") == [
        "10.1.0.7:50052",
        "10.1.0.9:50052",
    ]


def test_each_inference_replica_line_says_whether_rollout_routes_to_it_and_its_failed_pushes() -> None:
    from relayrl.common.pb import rollout_pb2, trainer_pb2
    from relayrl.common.service import as_dict
    from relayrl.status import render

    rollout = rollout_pb2.RolloutStatus(
        inference_replica_states=[
            rollout_pb2.InferenceReplica(address="10.0.0.1:50051", routable=True, samples_in_flight=8),
            rollout_pb2.InferenceReplica(address="10.0.0.2:50051", routable=True, behind=True, weight_version=3),
        ]
    )
    trainer = trainer_pb2.TrainerStatus(weight_push_failures={"10.0.0.2:50051": 2, "10.0.0.1:50051": 0})
    replica = {"component": {"state": "SERVING_STATE_SERVING"}, "weight_version": 4}
    state = {
        "services": {
            "inference": {"address": "10.0.0.1:50051", **replica},
            "rollout": {"address": "r:1", **as_dict(rollout)},
            "trainer": {"address": "t:1", **as_dict(trainer)},
        },
        "replicas": {"inference": [{"address": a, **replica} for a in ("10.0.0.1:50051", "10.0.0.2:50051")]},
    }
    assert as_dict(trainer)["weight_push_failures"] == {"10.0.0.2:50051": 2, "10.0.0.1:50051": 0}  # numbers

    lines = [line for line in render(state).splitlines() if line.startswith("  replica")]
    assert lines[0].endswith("(routed, 8 samples in flight)")
    assert lines[1].endswith("(NOT ROUTED, 0 samples in flight; 2 weight pushes failed)")
