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
