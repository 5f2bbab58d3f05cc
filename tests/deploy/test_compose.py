"""docker-compose.yml is valid and agrees with the run config it mounts (examples/compose.yaml).

Runs without a Docker engine: `docker-compose config -q` (Debian's docker-compose, v1) validates offline, and
the rest compares the parsed compose file with the config loaded by the project's own loader.
"""

from __future__ import annotations

import os
import re
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
CREDENTIALS = ("RELAYRL_CONTROL_TOKEN", "RELAYRL_WEIGHTS_TOKEN", "RELAYRL_CODE_TOKEN", "RELAYRL_REDIS_PASSWORD")


def _with_credentials(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYRL_")}
    return {**env, **{k: k.lower()[8:] + "-" + "x" * 24 for k in CREDENTIALS}, **values}


def _docker_compose() -> str:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail(
            "docker-compose is not installed; install it to validate docker-compose.yml offline: "
            "scripts/ensure_system_deps.sh (`make test` runs it; as root: apt-get install docker-compose)"
        )
    return binary


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
    result = subprocess.run(
        [_docker_compose(), "-f", str(COMPOSE_FILE), "config", "-q"],
        cwd=REPO,
        env=_with_credentials(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("missing", CREDENTIALS)
def test_compose_refuses_to_start_without_each_credential(missing: str) -> None:
    env = _with_credentials()
    del env[missing]

    result = subprocess.run(
        [_docker_compose(), "-f", str(COMPOSE_FILE), "config", "-q"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode != 0
    assert missing in result.stderr


def test_each_service_gets_only_the_credentials_it_needs(services: dict[str, dict[str, Any]]) -> None:
    wanted = {
        "inference": {"RELAYRL_WEIGHTS_TOKEN"},
        "trainer": {"RELAYRL_CONTROL_TOKEN", "RELAYRL_WEIGHTS_TOKEN", "RELAYRL_REDIS_PASSWORD"},
        "rollout": {"RELAYRL_CONTROL_TOKEN", "RELAYRL_CODE_TOKEN", "RELAYRL_REDIS_PASSWORD"},
        "reward": {"RELAYRL_CODE_TOKEN"},
        "init-model": set(),
        "redis": {"REDISCLI_AUTH"},
    }
    for name, keys in wanted.items():
        env = services[name].get("environment") or {}
        assert set(env) == keys, name
        source = {k: "RELAYRL_REDIS_PASSWORD" if k == "REDISCLI_AUTH" else k for k in keys}
        assert all(str(env[k]).startswith("${" + source[k] + ":?") for k in keys), name  # the caller's environment


def test_secret_values_reach_only_the_services_environment(compose: dict[str, Any]) -> None:
    secrets = {k: f"{k.lower()}-{i}-a1b2c3d4e5f6" for i, k in enumerate(CREDENTIALS)}
    result = subprocess.run(
        [_docker_compose(), "-f", str(COMPOSE_FILE), "config"],
        cwd=REPO,
        env=_with_credentials(**secrets),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]

    for name, service in resolved.items():
        outside_env = yaml.safe_dump({k: v for k, v in service.items() if k != "environment"})
        for value in secrets.values():
            assert value not in outside_env, f"{name}: a secret outside the environment (command line, labels?)"
    assert resolved["redis"]["environment"]["REDISCLI_AUTH"] == secrets["RELAYRL_REDIS_PASSWORD"]
    for value in secrets.values():
        assert value not in COMPOSE_FILE.read_text()


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


def test_output_and_model_volumes_are_named_and_cover_the_paths_each_service_uses(
    compose: dict[str, Any], services: dict[str, dict[str, Any]], run_cfg: RunConfig
) -> None:
    named = set(compose.get("volumes") or {})
    # (path, writable): trainer writes checkpoints, rollout its state; inference reads models and shared weights
    wanted = {
        "inference": [(run_cfg.model.path, False), (run_cfg.output_dir, False)],
        "trainer": [(run_cfg.model.path, False), (run_cfg.output_dir, True)],
        "rollout": [(run_cfg.output_dir, True)],
        "init-model": [(run_cfg.model.path, True)],
    }
    for name, paths in wanted.items():
        mounts = {target: (source, ro) for source, target, ro in map(_parse_volume, services[name]["volumes"])}
        for path, writable in paths:
            covering = [t for t in mounts if path == Path(t) or Path(t) in path.parents]
            assert covering, f"{name}: no volume holds {path}"
            source, read_only = mounts[covering[0]]
            assert source in named, f"{name}: {covering[0]} is not a named volume"
            assert read_only is not writable, f"{name}: {covering[0]} read_only={read_only}"


def test_reward_mounts_neither_training_data_nor_models(
    services: dict[str, dict[str, Any]], run_cfg: RunConfig
) -> None:
    mounts = [_parse_volume(v) for v in services["reward"].get("volumes", [])]

    assert [target for _, target, _ in mounts] == [CONFIG_IN_CONTAINER]
    assert all(read_only for _, _, read_only in mounts)
    for _, target, _ in mounts:
        for path in (run_cfg.output_dir, run_cfg.model.path):
            assert Path(target) not in (path, *path.parents), f"reward mounts {target}, which holds {path}"


def test_each_healthcheck_targets_configured_port_of_its_service(
    services: dict[str, dict[str, Any]], run_cfg: RunConfig
) -> None:
    for name in SERVICES:
        port = getattr(run_cfg, name).server.port
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1:4] == ["relayrl", "health", "--target"], f"{name}: {test}"
        assert test[4] == f"127.0.0.1:{port}", f"{name}: {test}"


def test_each_server_address_is_compose_service_name_and_configured_port(
    services: dict[str, dict[str, Any]], run_cfg: RunConfig
) -> None:
    for name in SERVICES:
        server = getattr(run_cfg, name).server
        assert server.host == "0.0.0.0", f"{name}: must bind all interfaces inside its container"
        host, port = _host_port(server.address)
        assert host == name and host in services, f"{name}: address {server.address}"
        assert port == server.port, f"{name}: address {server.address} vs port {server.port}"


def test_reward_scales_with_compose_up_scale_and_rollout_balances_over_its_replicas(
    services: dict[str, dict[str, Any]], run_cfg: RunConfig
) -> None:
    """`docker compose up --scale reward=3` (the file's header says so): nothing pins one container (a name, a host
    port), and the address rollout dials is the service's name, which compose's DNS answers with every replica."""
    reward = services["reward"]
    assert "container_name" not in reward and not reward.get("ports")
    assert _host_port(run_cfg.reward.server.address)[0] == "reward"
    assert run_cfg.reward.server.max_connection_age_s > 0  # replicas added later are found when connections age
    assert "docker compose up --scale reward=3" in COMPOSE_FILE.read_text()


def test_only_inference_client_ports_are_published_and_only_on_host_loopback(
    services: dict[str, dict[str, Any]], run_cfg: RunConfig
) -> None:
    published = {name: s["ports"] for name, s in services.items() if s.get("ports") or s.get("expose")}
    assert set(published) == {"inference"}, "only inference is called from the host (redis, weights port: never)"
    container_ports = set()
    for mapping in published["inference"]:
        host_ip, host_port, container = str(mapping).split(":")  # short syntax with the host address
        assert host_ip == "127.0.0.1", f"{mapping}: published beyond the host's loopback"
        container_ports.add(int(container.split("/")[0]))
        assert int(host_port) == int(container.split("/")[0])
    # Generate/GetStatus and the REST API; not the weights port (UpdateWeights, the trainer only)
    assert container_ports == {run_cfg.inference.server.port, run_cfg.inference.http.port}


def test_redis_url_host_is_redis_service_with_its_port(services: dict[str, dict[str, Any]], run_cfg: RunConfig) -> None:
    url = urlparse(run_cfg.redis.url)
    assert url.scheme == "redis"
    assert url.hostname in services and "redis" in str(services[url.hostname]["image"])
    assert (url.port or 6379) == 6379


def test_redis_is_pinned_durable_and_never_evicts(services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    image = str(redis["image"])
    assert ":" in image and not image.endswith(":latest") and any(c.isdigit() for c in image.split(":")[1])
    command = [str(c) for c in redis["command"]]  # redis-server's arguments, after the entrypoint's script
    for flag, value in (("--appendonly", "yes"), ("--appendfsync", "everysec"), ("--maxmemory-policy", "noeviction")):
        assert flag in command and command[command.index(flag) + 1] == value, f"{flag} {value} in {command}"
    assert any(_parse_volume(v)[1] == "/data" for v in redis.get("volumes", []))
    # redis-cli exits 0 on an error reply (NOAUTH) too: the check must look for PONG
    assert redis["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli ping | grep -qx PONG"]


def test_redis_requires_a_password_given_on_no_command_line(services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    entrypoint = [str(a) for a in redis["entrypoint"]]

    assert entrypoint[:2] == ["sh", "-c"] and 'exec redis-server "$$@" -' in entrypoint[2]
    assert 'requirepass "$$REDISCLI_AUTH"' in entrypoint[2]  # $$: expanded by sh inside the container
    assert not any("requirepass" in str(a) or "REDISCLI_AUTH" in str(a) for a in redis["command"])


def test_every_depends_on_waits_for_health_or_init_completion(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for dep, spec in _depends_on(service).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            expected = (
                "service_completed_successfully"
                if "command" in services[dep] and services[dep]["command"][0] == "init-model"
                else "service_healthy"
            )
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


def test_sandbox_override_loosens_only_the_reward_container() -> None:
    override = REPO / "docker-compose.sandbox.yml"
    data = yaml.safe_load(override.read_text())

    result = subprocess.run(
        [_docker_compose(), "-f", str(COMPOSE_FILE), "-f", str(override), "config", "-q"],
        cwd=REPO,
        env=_with_credentials(),
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 0, result.stderr
    assert data == {
        "services": {
            "reward": {"security_opt": ["seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"]}
        }
    }
    assert "security_opt" not in yaml.safe_load(COMPOSE_FILE.read_text())["services"]["reward"]


def test_replicas_override_adds_a_second_inference_that_rollout_and_the_trainer_both_list() -> None:
    """docker-compose.replicas.yml: inference-2 runs as inference does (image, config, volumes, credential,
    healthcheck) but publishes no host port; rollout and the trainer get both replicas in inference.endpoints, each by
    its service name and the config's ports, and wait for both to be healthy."""
    override = REPO / "docker-compose.replicas.yml"
    result = subprocess.run(
        [_docker_compose(), "-f", str(COMPOSE_FILE), "-f", str(override), "config"],
        cwd=REPO,
        env=_with_credentials(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    merged = yaml.safe_load(result.stdout)["services"]
    first, second = merged["inference"], merged["inference-2"]
    for key in ("image", "command", "volumes", "environment", "healthcheck", "depends_on"):
        assert second[key] == first[key], key
    assert "ports" not in second and first["ports"]

    cfg = load_run_config(RUN_CONFIG)
    for name in ("rollout", "trainer"):
        command = merged[name]["command"]
        assert command[:3] == ["serve", name, CONFIG_IN_CONTAINER] and command[3] == "--set"
        endpoints = load_run_config(RUN_CONFIG, [command[4]]).inference.replica_endpoints()
        assert [(e.address, e.weights_address) for e in endpoints] == [
            (f"{svc}:{cfg.inference.server.port}", f"{svc}:{cfg.inference.weights_server.port}")
            for svc in ("inference", "inference-2")
        ]
        assert merged[name]["depends_on"]["inference-2"] == {"condition": "service_healthy"}


@pytest.mark.parametrize("page", ["README.md", "docs/deploy.md"])
def test_the_documented_compose_steps_export_every_credential_the_file_requires(page: str) -> None:
    required = set(re.findall(r"\$\{(RELAYRL_\w+):\?", (REPO / "docker-compose.yml").read_text()))
    text = (REPO / page).read_text()
    end = text.index("docker compose up")
    steps = text[max(0, end - 1500) : end]  # the lines that lead up to the first `docker compose up`
    assert required and not {name for name in required if name not in steps}, sorted(required)
