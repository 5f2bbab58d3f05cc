"""The Helm chart (charts/relayrl) lints, renders valid Kubernetes objects, and agrees with relayrl's config.

Runs without a cluster or a helm binary: `helm-python-sdk` wraps Helm's Go library (lint and render offline),
`kubernetes-validate` checks every rendered object against the Kubernetes OpenAPI schemas it ships, and the
rendered ConfigMap's run config goes through the project's own loader, so a stale key in values.yaml fails here.
Value sets: the chart's defaults and each charts/relayrl/ci/*-values.yaml.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from relayrl.cli import SERVICES
from relayrl.config.typed import ConfigError
from tests.deploy.chart import (
    CHART,
    CRD_KINDS,
    KUBE_VERSIONS,
    OFFLINE,
    VALUE_SETS,
    _chart,
    checksums,
    component,
    config_text,
    load_config,
    main_container,
    merged,
    render,
    render_error,
    rendered,
    service,
    value_set,
    workload,
)

# -- lint and schemas ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_chart_passes_strict_lint_with_only_the_icon_info(name: str) -> None:
    report = helm.lint(CHART, value_set(name), strict=True, kube_version="v1.31.0")
    assert report["errors"] == [], report
    assert report["total_charts_linted"] == 1
    # severity 1 = info; the chart has no icon on purpose (no hosted image to point at)
    assert [(m["severity"], m["error"]) for m in report["messages"]] == [(1, "icon is recommended")], report


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_object_validates_against_kubernetes_schemas(name: str) -> None:
    docs = rendered(name)
    assert len(docs) >= 15
    for version in KUBE_VERSIONS:
        for doc in (d for d in docs if d["kind"] not in CRD_KINDS):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"{name}, Kubernetes {version}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} "
                    f"at {'/'.join(map(str, exc.absolute_path))}"
                )


def test_schema_validation_rejects_a_misspelt_container_field() -> None:
    deployment = workload(rendered("default"), "inference")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[0], strict=True)


def test_values_schema_rejects_unknown_keys_and_impossible_sizes() -> None:
    assert "nodez" in render_error({"trainer": {"nodez": 2}})
    assert "/trainer/nodes" in render_error({"trainer": {"nodes": 0}})
    assert "/redis/external/url" in render_error({"redis": {"external": {"url": "http://redis:6379"}}})


# -- the run config in the ConfigMap -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_configmap_config_loads_with_service_addresses_and_chart_owned_keys(name: str, tmp_path: Path) -> None:
    docs = rendered(name)
    cfg = load_config(docs, tmp_path)
    values = merged(_chart().values, value_set(name))
    for svc in SERVICES:
        server = getattr(cfg, svc).server
        assert server.host == "0.0.0.0" and server.port == values[svc]["port"], svc
        host, _, port = server.address.rpartition(":")
        assert int(port) == server.port, svc
        ports = [p["port"] for p in service(docs, host)["spec"]["ports"]]
        assert server.port in ports, f"{svc}: Service {host} has ports {ports}"
        container = main_container(docs, svc)
        assert server.port in [p["containerPort"] for p in container["ports"]], svc
    assert cfg.output_dir == Path(values["trainer"]["persistence"]["mountPath"]) / values["run"]["id"]
    assert cfg.name == values["run"]["id"]  # every Redis key of the run carries it: a new id starts clean
    assert cfg.trainer.distributed.world_size == values["trainer"]["nodes"] * values["trainer"]["nprocPerNode"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_http_apis_in_the_config_match_their_container_and_service_ports(name: str, tmp_path: Path) -> None:
    docs = rendered(name)
    cfg = load_config(docs, tmp_path)
    values = merged(_chart().values, value_set(name))
    with_http = [svc for svc in SERVICES if "httpPort" in values[svc]]
    assert "inference" in with_http  # the OpenAI-compatible API
    for svc in with_http:
        http = getattr(cfg, svc).http
        assert http.enabled and http.host == "0.0.0.0" and http.port == values[svc]["httpPort"], svc
        assert {"name": "http", "containerPort": http.port, "protocol": "TCP"} in main_container(docs, svc)["ports"]
        # on the component's Service (reward's gRPC address is its headless Service, without the REST port)
        assert http.port in [p["port"] for p in service(docs, f"rl-relayrl-{svc}")["spec"]["ports"]], svc


def test_small_floats_in_values_load_as_floats(tmp_path: Path) -> None:
    cfg = load_config(rendered("multinode-gpu"), tmp_path)
    assert cfg.trainer.optimizer.lr == pytest.approx(1e-6)
    cfg = load_config(render({"config": {"trainer": {"optimizer": {"lr": 1.0e-7, "weight_decay": 2.5e-12}}}}), tmp_path)
    assert cfg.trainer.optimizer.lr == pytest.approx(1e-7)
    assert cfg.trainer.optimizer.weight_decay == pytest.approx(2.5e-12)


def test_values_with_the_former_flat_trainer_keys_still_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    flat = {
        "lr": 1.0e-7,
        "checkpoint_every": 7,
        "resume": "never",
        "weight_transport": "shared_path",
        "collective_timeout_s": 30,
    }
    with caplog.at_level(logging.WARNING):
        cfg = load_config(render({"config": {"trainer": flat}}), tmp_path)

    assert cfg.trainer.optimizer.lr == pytest.approx(1e-7)
    assert (cfg.trainer.checkpoint.every, cfg.trainer.checkpoint.resume) == (7, "never")
    assert cfg.trainer.publication.transport.value == "shared_path"
    assert cfg.trainer.distributed.collective_timeout_s == 30
    assert cfg.trainer.distributed.world_size == 1  # still the chart's
    assert any("trainer.lr" in r.getMessage() and "trainer.optimizer.lr" in r.getMessage() for r in caplog.records)


def test_stale_config_key_in_values_fails_the_project_loader(tmp_path: Path) -> None:
    docs = render({"config": {"trainer": {"learning_rate": 0.001}}})
    with pytest.raises(ConfigError, match=r"trainer\.learning_rate"):
        load_config(docs, tmp_path)


def test_redis_url_points_at_the_redis_service(tmp_path: Path) -> None:
    docs = rendered("default")
    cfg = load_config(docs, tmp_path)
    match = re.fullmatch(r"redis://([^:/]+):(\d+)/0", cfg.redis.url)
    assert match, cfg.redis.url
    redis = service(docs, match.group(1))
    assert component(redis) == "redis" and int(match.group(2)) in [p["port"] for p in redis["spec"]["ports"]]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"trainer": {"world_size": 3}}, "config.trainer.distributed.world_size is set by the chart"),
        ({"inference": {"server": {"port": 9000}}}, "config.inference.server.port is set by the chart"),
        ({"redis": {"url": "redis://elsewhere:6379/0"}}, "config.redis.url is set by the chart"),
        ({"output_dir": "/elsewhere"}, "config.output_dir is set by the chart"),
        ({"inference": {"weights_server": {"port": 9000}}}, "config.inference.weights_server.port is set by the chart"),
        ({"trainer": {"groups_per_step": 6}}, "must be divisible by the trainer's world size"),
        ({"inference": {"replicas": 2}}, "config.inference.replicas is set by the chart"),
        ({"inference": {"endpoints": []}}, "config.inference.endpoints is set by the chart"),
    ],
)
def test_render_refuses_config_keys_the_chart_owns(config: dict[str, Any], message: str) -> None:
    values = (
        {"config": config, "trainer": {"nprocPerNode": 4}} if "groups_per_step" in str(config) else {"config": config}
    )
    assert message in render_error(values)


def test_the_run_is_named_after_run_id_and_an_older_values_files_config_name_is_replaced_with_a_notice(
    tmp_path: Path,
) -> None:
    values = {"run": {"id": "exp-7"}, "config": {"name": "old"}, **OFFLINE}
    files = _chart().render(values, name="rl", namespace="ns")
    assert "DEPRECATED: config.name (old) is ignored" in files["relayrl/templates/NOTES.txt"]
    docs = render({"run": {"id": "exp-7"}, "config": {"name": "old"}})
    assert load_config(docs, tmp_path).name == "exp-7"


# -- rolling on config changes -------------------------------------------------------------------------------------


def test_config_checksum_is_stable_and_changes_with_the_run_config() -> None:
    first, again = checksums(render({})), checksums(render({}))
    assert first == again
    assert set(first) == {
        f"{kind}/rl-relayrl-{svc}"
        for svc, kind in (
            ("inference", "StatefulSet"),
            ("reward", "Deployment"),
            ("rollout", "Deployment"),
            ("trainer", "StatefulSet"),
        )
    }
    assert len(set(first.values())) == 1
    changed = checksums(render({"config": {"trainer": {"lr": 0.001}}}))
    assert all(changed[k] != first[k] for k in first), (first, changed)
    unrelated = checksums(render({"reward": {"replicas": 3}}))
    assert unrelated == first


def test_config_checksum_is_the_sha256_of_the_configmap_config() -> None:
    docs = rendered("small-cpu")
    digest = hashlib.sha256(config_text(docs).rstrip("\n").encode()).hexdigest()
    assert set(checksums(docs).values()) == {digest}
