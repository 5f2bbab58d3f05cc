"""docker-compose.yml is valid and agrees with the run config it mounts (examples/compose.yaml).

Runs without a Docker engine: `docker-compose config -q` (Debian's docker-compose, v1) validates offline, and
the rest compares the parsed compose file with the config loaded by the project's own loader.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from relayrl.cli import SERVICES
from relayrl.config import RunConfig, load_run_config
from tests.conftest import REPO

COMPOSE_FILE = REPO / "docker-compose.yml"
RUN_CONFIG = REPO / "examples" / "compose.yaml"
CONFIG_IN_CONTAINER = "/config/relayrl.yaml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


@pytest.fixture(scope="module")
def run_cfg() -> RunConfig:
    return load_run_config(RUN_CONFIG)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _parse_volume(volume: str | dict[str, Any]) -> tuple[str, str, bool]:
    """(source, target, read_only) of a short- or long-syntax volume entry."""
    if isinstance(volume, dict):
        return str(volume.get("source", "")), str(volume["target"]), bool(volume.get("read_only", False))
    parts = volume.split(":")
    mode = parts[2] if len(parts) > 2 else "rw"
    return parts[0], parts[1], "ro" in mode.split(",")


def _depends_on(service: dict[str, Any]) -> dict[str, Any]:
    deps = service.get("depends_on", {})
    assert isinstance(deps, dict), "depends_on must use the long form with a condition"
    return deps


def test_compose_file_validates_with_docker_compose_config_exit_zero() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed; install it to validate docker-compose.yml offline: "
                    "scripts/ensure_system_deps.sh (`make test` runs it; as root: apt-get install docker-compose)")
    env = {**os.environ, "RELAYRL_CONTROL_TOKEN": "c" * 32, "RELAYRL_WEIGHTS_TOKEN": "w" * 32}
    result = subprocess.run([binary, "-f", str(COMPOSE_FILE), "config", "-q"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_refuses_to_start_without_the_credentials() -> None:
    binary = shutil.which("docker-compose")
    assert binary is not None, "docker-compose is not installed: scripts/ensure_system_deps.sh"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYRL_")}

    result = subprocess.run([binary, "-f", str(COMPOSE_FILE), "config", "-q"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)

    assert result.returncode != 0
    assert "RELAYRL_CONTROL_TOKEN" in result.stderr or "RELAYRL_WEIGHTS_TOKEN" in result.stderr


def test_each_service_gets_only_the_credentials_it_needs(services: dict[str, dict[str, Any]]) -> None:
    wanted = {"inference": {"RELAYRL_WEIGHTS_TOKEN"}, "trainer": {"RELAYRL_CONTROL_TOKEN", "RELAYRL_WEIGHTS_TOKEN"},
              "rollout": {"RELAYRL_CONTROL_TOKEN"}, "reward": set(), "init-model": set(), "redis": set()}
    for name, keys in wanted.items():
        env = services[name].get("environment") or {}
        assert {k for k in env if k.endswith("_TOKEN")} == keys, name
        assert all(str(env[k]).startswith("${" + k + ":?") for k in keys), name  # from the caller's environment


def test_run_config_loads_through_project_loader_with_compose_paths(run_cfg: RunConfig) -> None:
    assert run_cfg.model.path == Path("/models/tiny")
    assert str(run_cfg.output_dir).startswith("/runs/")
    assert run_cfg.rollout.dataset == Path("/app/examples/data/arithmetic.jsonl")
    assert (REPO / "examples" / "data" / "arithmetic.jsonl").is_file()  # what the Dockerfile copies to /app
    assert "COPY examples ./examples" in (REPO / "Dockerfile").read_text()


def test_each_service_command_serves_itself_with_mounted_config(services: dict[str, dict[str, Any]]) -> None:
    for name in SERVICES:
        assert services[name]["command"] == ["serve", name, CONFIG_IN_CONTAINER], name


def test_config_mount_is_read_only_and_is_examples_compose_yaml(services: dict[str, dict[str, Any]]) -> None:
    for name in SERVICES:
        mounts = [_parse_volume(v) for v in services[name].get("volumes", [])]
        config = [m for m in mounts if m[1] == CONFIG_IN_CONTAINER]
        assert len(config) == 1, f"{name}: mounts {mounts}"
        source, _, read_only = config[0]
        assert read_only, f"{name}: {CONFIG_IN_CONTAINER} must be mounted read-only"
        assert (REPO / source).resolve() == RUN_CONFIG.resolve(), f"{name}: mounts {source}"


def test_output_and_model_volumes_are_named_and_cover_config_paths(
        compose: dict[str, Any], services: dict[str, dict[str, Any]], run_cfg: RunConfig) -> None:
    named = set(compose.get("volumes") or {})
    for name in SERVICES:
        mounts = {target: source for source, target, _ in map(_parse_volume, services[name].get("volumes", []))}
        for path in (run_cfg.output_dir, run_cfg.model.path):
            covering = [t for t in mounts if path == Path(t) or Path(t) in path.parents]
            assert covering, f"{name}: no volume holds {path}"
            assert mounts[covering[0]] in named, f"{name}: {covering[0]} is not a named volume"


def test_each_healthcheck_targets_configured_port_of_its_service(
        services: dict[str, dict[str, Any]], run_cfg: RunConfig) -> None:
    for name in SERVICES:
        port = getattr(run_cfg, name).server.port
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1:4] == ["relayrl", "health", "--target"], f"{name}: {test}"
        assert test[4] == f"127.0.0.1:{port}", f"{name}: {test}"


def test_each_server_address_is_compose_service_name_and_configured_port(
        services: dict[str, dict[str, Any]], run_cfg: RunConfig) -> None:
    for name in SERVICES:
        server = getattr(run_cfg, name).server
        assert server.host == "0.0.0.0", f"{name}: must bind all interfaces inside its container"
        host, port = _host_port(server.address)
        assert host == name and host in services, f"{name}: address {server.address}"
        assert port == server.port, f"{name}: address {server.address} vs port {server.port}"


def test_published_ports_only_map_configured_grpc_and_http_ports(
        services: dict[str, dict[str, Any]], run_cfg: RunConfig) -> None:
    assert services["inference"].get("ports"), "inference's gRPC port is published for clients"
    for name, service in services.items():
        for mapping in service.get("ports", []):
            container_port = int(str(mapping).rsplit(":", 1)[-1].split("/")[0])
            assert name in SERVICES, f"{name}: {mapping}"
            section = getattr(run_cfg, name)
            http = getattr(section, "http", None)
            allowed = {section.server.port} | ({http.port} if http is not None and http.enabled else set())
            assert container_port in allowed, f"{name}: {mapping}"


def test_redis_url_host_is_redis_service_with_its_port(
        services: dict[str, dict[str, Any]], run_cfg: RunConfig) -> None:
    url = urlparse(run_cfg.redis.url)
    assert url.scheme == "redis"
    assert url.hostname in services and "redis" in str(services[url.hostname]["image"])
    assert (url.port or 6379) == 6379


def test_redis_is_pinned_durable_and_never_evicts(services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    image = str(redis["image"])
    assert ":" in image and not image.endswith(":latest") and any(c.isdigit() for c in image.split(":")[1])
    command = redis["command"]
    command = command.split() if isinstance(command, str) else [str(c) for c in command]
    for flag, value in (("--appendonly", "yes"), ("--appendfsync", "everysec"), ("--maxmemory-policy", "noeviction")):
        assert flag in command and command[command.index(flag) + 1] == value, f"{flag} {value} in {command}"
    assert any(_parse_volume(v)[1] == "/data" for v in redis.get("volumes", []))
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]


def test_every_depends_on_waits_for_health_or_init_completion(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for dep, spec in _depends_on(service).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            expected = "service_completed_successfully" if "command" in services[dep] and \
                services[dep]["command"][0] == "init-model" else "service_healthy"
            assert spec["condition"] == expected, f"{name} -> {dep}: {spec}"
            if expected == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"


def test_start_order_matches_who_calls_whom(services: dict[str, dict[str, Any]], run_cfg: RunConfig) -> None:
    assert set(_depends_on(services["rollout"])) >= {"inference", "reward", "trainer", "redis"}
    assert set(_depends_on(services["trainer"])) >= {"inference", "redis"}
    for name in ("inference", "trainer"):
        assert _depends_on(services[name])["init-model"]["condition"] == "service_completed_successfully"
    assert services["init-model"]["command"][:3] == ["init-model", "--out", str(run_cfg.model.path)]


def test_services_share_one_image_built_from_repo_dockerfile(services: dict[str, dict[str, Any]]) -> None:
    for name in (*SERVICES, "init-model"):
        assert services[name]["build"] in (".", {"context": "."}), name
        assert services[name]["image"] == services["inference"]["image"], name
