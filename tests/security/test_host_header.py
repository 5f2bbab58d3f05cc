"""DNS rebinding: a web page whose name resolves to 127.0.0.1 makes the browser send its own name as ``Host``; every
REST server (relayrl.common.http.HttpServer: inference, reward, rollout, trainer, agent sessions) and the dashboard
answer only the names of ``http.allowed_hosts``, IP addresses and their bind host, refusing others with 400 before
any route (or the body limit) runs. The servers of a whole run: tests/security/test_run_exposure.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from relayrl.common.control_api import control_app
from relayrl.common.http import HttpServer, host_allowed
from relayrl.common.pb import rollout_pb2
from relayrl.config.agents import AgentConfig
from relayrl.config.endpoints import HttpConfig
from relayrl.config.typed import ConfigError, validate_tree
from relayrl.dashboard import DashboardServer
from relayrl.rollout.workflows.agent_chat import Renderer
from relayrl.rollout.workflows.agent_proxy import Sampling, SessionProxy
from relayrl.rollout.workflows.agent_session import Session, SessionLimits

pytestmark = pytest.mark.security

EVIL = ("evil.example", "evil.example:8000", "localhost.evil.example", "[evil]:80", "")
LOOPBACK = ("localhost", "127.0.0.1", "[::1]", "LOCALHOST.")


async def _statuses(url: str, hosts: tuple[str, ...], method: str = "GET", body: bytes = b"") -> list[int]:
    async with httpx.AsyncClient(timeout=10) as client:
        return [(await client.request(method, url, headers={"Host": h}, content=body)).status_code for h in hosts]


def _counting_app() -> tuple[FastAPI, list[str]]:
    app = FastAPI()
    calls: list[str] = []

    @app.api_route("/probe", methods=["GET", "POST"])
    async def probe() -> dict[str, str]:
        calls.append("probe")
        return {"ok": "yes"}

    return app, calls


async def _serve(app: Any, cfg: HttpConfig, *requests: tuple[str, tuple[str, ...], str, bytes]) -> list[list[int]]:
    async def go() -> list[list[int]]:
        server = HttpServer(app, cfg, "test")
        await server.start()
        try:
            return [
                await _statuses(f"http://127.0.0.1:{server.port}{path}", hosts, method, body)
                for path, hosts, method, body in requests
            ]
        finally:
            await server.stop()

    return await go()


async def test_another_hosts_name_is_refused_before_the_route_and_before_the_body_is_read() -> None:
    app, calls = _counting_app()
    cfg = HttpConfig(port=0, max_body_mib=1)
    evil, big, loopback = await _serve(
        app,
        cfg,
        ("/probe", EVIL, "GET", b""),
        ("/probe", ("evil.example",), "POST", b"x" * (2 * 1024 * 1024)),
        ("/probe", LOOPBACK, "GET", b""),
    )
    assert evil == [400] * len(EVIL) and big == [400]  # not 413: refused before the body limit reads anything
    assert loopback == [200] * len(LOOPBACK) and calls == ["probe"] * len(LOOPBACK)


async def test_configured_names_the_bind_host_and_ip_addresses_are_answered() -> None:
    app, _ = _counting_app()
    cfg = HttpConfig(host="127.0.0.1", port=0, allowed_hosts=["inference", "*.svc.cluster.local"])
    hosts = ("inference:8000", "rl-inference.ml.svc.cluster.local", "10.1.2.3:8000", "[fe80::1]:8000")
    assert await _serve(
        app, cfg, ("/probe", hosts, "GET", b""), ("/probe", ("svc.cluster.local", "infer"), "GET", b"")
    ) == [
        [200] * 4,
        [400, 400],
    ]
    assert host_allowed("myhost:80", [], bind_host="myhost") and not host_allowed("myhost", [], bind_host="0.0.0.0")


async def test_a_star_answers_any_name() -> None:
    app, _ = _counting_app()
    assert await _serve(app, HttpConfig(port=0, allowed_hosts=["*"]), ("/probe", ("evil.example",), "GET", b"")) == [
        [200]
    ]


@pytest.mark.parametrize("name", ["http://inference", "inference:8000", "a b", "", "inference/x", "user@host"])
def test_an_allowed_host_with_a_port_scheme_or_path_is_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match="allowed_hosts"):
        validate_tree(HttpConfig(allowed_hosts=[name]))


async def test_control_api_refuses_another_hosts_name_before_any_route() -> None:
    calls: list[str] = []

    async def pause() -> rollout_pb2.RolloutStatus:
        calls.append("pause")
        return rollout_pb2.RolloutStatus()

    app = control_app("rollout", rollout_pb2.RolloutStatus, lambda: "", "t0k3n", CollectorRegistry(), {"/pause": pause})
    cfg = HttpConfig(port=0)
    statuses = await _serve(
        app,
        cfg,
        ("/metrics", ("evil.example",), "GET", b""),
        ("/status", ("evil.example",), "GET", b""),
        ("/config", ("evil.example",), "GET", b""),
        ("/metrics", ("localhost",), "GET", b""),
    )
    assert statuses == [[400], [400], [400], [200]]
    assert calls == []


async def test_agent_session_proxy_refuses_another_hosts_name() -> None:
    proxy = SessionProxy(AgentConfig(), Renderer(None), Sampling())

    async def go() -> tuple[list[int], list[int]]:
        await proxy.start()
        try:
            _, url = proxy.open(Session(SessionLimits(4, 4, 16, 16), 60), None, "g")
            return (
                await _statuses(f"{url}/models", ("evil.example",)),
                await _statuses(f"{url}/models", (f"127.0.0.1:{proxy.port}",)),
            )
        finally:
            await proxy.stop()

    assert await go() == ([400], [200])


async def test_dashboard_refuses_another_hosts_name(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    with DashboardServer(tmp_path) as dashboard:
        dashboard.start()
        evil = await _statuses(f"{dashboard.url}api/metrics", EVIL)
        loopback = await _statuses(f"{dashboard.url}api/metrics", LOOPBACK)
        named = DashboardServer(tmp_path, allowed_hosts=("localhost", "box.lan"))
        with named:
            named.start()
            box = await _statuses(f"{named.url}", ("box.lan:9000", "evil.example"))
    assert evil == [400] * len(EVIL) and loopback == [200] * len(LOOPBACK) and box == [200, 400]


def test_the_default_http_section_answers_loopback_names_only() -> None:
    cfg = replace(HttpConfig(), host="0.0.0.0")
    assert cfg.allowed_hosts == ["localhost"]
    assert host_allowed("localhost:1", cfg.allowed_hosts, cfg.host)
    assert not host_allowed("inference:8000", cfg.allowed_hosts, cfg.host)
