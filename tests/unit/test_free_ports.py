"""The launcher's ports (relayrl.local_redis.free_ports): distinct, bindable, and outside the kernel's ephemeral
range, from which outgoing connections take their local ports while the services start (a port picked there was
taken before inference could bind it, in CI)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from relayrl import local_redis
from relayrl.local_redis import free_ports


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    if not local_redis.EPHEMERAL_RANGE.exists():
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range: the kernel picks (port 0)")
    low = int(local_redis.EPHEMERAL_RANGE.read_text().split()[0])
    ports = free_ports(12)
    assert len(set(ports)) == 12
    assert all(local_redis.LOWEST_PICKED_PORT <= p < low for p in ports), ports
    assert all(_bindable(p) for p in ports)


def test_without_a_known_ephemeral_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(local_redis, "EPHEMERAL_RANGE", tmp_path / "absent")
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(_bindable(p) for p in ports)


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(local_redis, "_listen_range", lambda: range(taken, taken + 1))  # only the taken port
        ports = free_ports(2)
        assert taken not in ports and len(set(ports)) == 2
