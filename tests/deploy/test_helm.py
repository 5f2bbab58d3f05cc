"""The Helm chart (charts/relayrl) lints, renders valid Kubernetes objects, and agrees with relayrl's config.

Runs without a cluster or a helm binary: `helm-python-sdk` wraps Helm's Go library (lint and render offline),
`kubernetes-validate` checks every rendered object against the Kubernetes OpenAPI schemas it ships, and the
rendered ConfigMap's run config goes through the project's own loader, so a stale key in values.yaml fails here.
Value sets: the chart's defaults and each charts/relayrl/ci/*-values.yaml.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import re
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from relayrl.cli import SERVICES
from relayrl.common.config import ConfigError
from relayrl.common.pb import inference_pb2, reward_pb2, rollout_pb2, trainer_pb2
from relayrl.config import RunConfig, load_run_config
from tests.conftest import REPO

CHART = REPO / "charts" / "relayrl"
VALUE_SETS = ("default", "small-cpu", "multinode-gpu", "external-redis")
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
RELEASE, NAMESPACE = "rl", "ml"
CONFIG_PATH = "/config/relayrl.yaml"
HEALTH_NAMES = {
    "inference": inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,
    "reward": reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name,
    "rollout": rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name,
    "trainer": trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name,
}
WORKLOADS = ("Deployment", "StatefulSet")

Manifest = dict[str, Any]


def value_set(name: str) -> dict[str, Any]:
    if name == "default":
        return {}
    data = yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())
    assert isinstance(data, dict)
    return data


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render(values: dict[str, Any]) -> list[Manifest]:
    files = _chart().render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs: list[Manifest] = []
    for path, text in sorted(files.items()):
        if path.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


@cache
def _rendered(name: str) -> tuple[Manifest, ...]:
    return tuple(render(value_set(name)))


def rendered(name: str) -> list[Manifest]:
    return copy.deepcopy(list(_rendered(name)))


def objects(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind]


def component(doc: Manifest) -> str:
    return str(doc["metadata"]["labels"].get("app.kubernetes.io/component", ""))


def workload(docs: list[Manifest], svc: str) -> Manifest:
    found = [d for d in docs if d["kind"] in WORKLOADS and component(d) == svc]
    assert len(found) == 1, f"{svc}: {[d['metadata']['name'] for d in found]}"
    return found[0]


def service(docs: list[Manifest], name: str) -> Manifest:
    found = [d for d in objects(docs, "Service") if d["metadata"]["name"] == name]
    assert len(found) == 1, name
    return found[0]


def pod_specs(docs: list[Manifest]) -> dict[str, Manifest]:
    """Every pod spec the release creates: workloads' templates and bare pods (the helm test pod)."""
    specs = {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"]
             for d in docs if d["kind"] in WORKLOADS}
    specs.update({f"Pod/{d['metadata']['name']}": d["spec"] for d in objects(docs, "Pod")})
    return specs


def main_container(docs: list[Manifest], svc: str) -> Manifest:
    (container,) = [c for c in workload(docs, svc)["spec"]["template"]["spec"]["containers"] if c["name"] == svc]
    return container


def config_text(docs: list[Manifest]) -> str:
    (cm,) = objects(docs, "ConfigMap")
    return str(cm["data"]["relayrl.yaml"])


def load_config(docs: list[Manifest], tmp_path: Path) -> RunConfig:
    path = tmp_path / "relayrl.yaml"
    path.write_text(config_text(docs))
    return load_run_config(path)


def checksums(docs: list[Manifest]) -> dict[str, str]:
    return {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            for d in docs if d["kind"] in WORKLOADS and component(d) != "redis"}


def render_error(values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmError) as info:
        render(values)
    return str(info.value)


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
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}, Kubernetes {version}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} "
                            f"at {'/'.join(map(str, exc.absolute_path))}")


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
    assert cfg.output_dir == Path(values["trainer"]["persistence"]["mountPath"])
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
        host = getattr(cfg, svc).server.address.rpartition(":")[0]
        assert http.port in [p["port"] for p in service(docs, host)["spec"]["ports"]], svc


def test_small_floats_in_values_load_as_floats(tmp_path: Path) -> None:
    cfg = load_config(rendered("multinode-gpu"), tmp_path)
    assert cfg.trainer.optimizer.lr == pytest.approx(1e-6)
    cfg = load_config(render({"config": {"trainer": {"optimizer": {"lr": 1.0e-7, "weight_decay": 2.5e-12}}}}),
                      tmp_path)
    assert cfg.trainer.optimizer.lr == pytest.approx(1e-7)
    assert cfg.trainer.optimizer.weight_decay == pytest.approx(2.5e-12)


def test_values_with_the_former_flat_trainer_keys_still_load(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    flat = {"lr": 1.0e-7, "checkpoint_every": 7, "resume": "never", "weight_transport": "shared_path",
            "collective_timeout_s": 30}
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


@pytest.mark.parametrize(("config", "message"), [
    ({"trainer": {"world_size": 3}}, "config.trainer.distributed.world_size is set by the chart"),
    ({"inference": {"server": {"port": 9000}}}, "config.inference.server.port is set by the chart"),
    ({"redis": {"url": "redis://elsewhere:6379/0"}}, "config.redis.url is set by the chart"),
    ({"output_dir": "/elsewhere"}, "config.output_dir is set by the chart"),
    ({"inference": {"weights_server": {"port": 9000}}}, "config.inference.weights_server.port is set by the chart"),
    ({"trainer": {"groups_per_step": 6}}, "must be divisible by the trainer's world size"),
])
def test_render_refuses_config_keys_the_chart_owns(config: dict[str, Any], message: str) -> None:
    values = {"config": config, "trainer": {"nprocPerNode": 4}} if "groups_per_step" in str(config) \
        else {"config": config}
    assert message in render_error(values)


# -- rolling on config changes -------------------------------------------------------------------------------------

def test_config_checksum_is_stable_and_changes_with_the_run_config() -> None:
    first, again = checksums(render({})), checksums(render({}))
    assert first == again
    assert set(first) == {f"{kind}/rl-relayrl-{svc}" for svc, kind in (
        ("inference", "Deployment"), ("reward", "Deployment"), ("rollout", "Deployment"),
        ("trainer", "StatefulSet"))}
    assert len(set(first.values())) == 1
    changed = checksums(render({"config": {"trainer": {"lr": 0.001}}}))
    assert all(changed[k] != first[k] for k in first), (first, changed)
    unrelated = checksums(render({"reward": {"replicas": 3}}))
    assert unrelated == first


def test_config_checksum_is_the_sha256_of_the_configmap_config() -> None:
    docs = rendered("small-cpu")
    digest = hashlib.sha256(config_text(docs).rstrip("\n").encode()).hexdigest()
    assert set(checksums(docs).values()) == {digest}


# -- trainer: StatefulSet, torchrun, world size --------------------------------------------------------------------

def test_multinode_trainer_runs_torchrun_with_c10d_rendezvous_at_pod_zero(tmp_path: Path) -> None:
    docs = rendered("multinode-gpu")
    cfg = load_config(docs, tmp_path)
    sts = workload(docs, "trainer")
    assert sts["kind"] == "StatefulSet" and sts["spec"]["podManagementPolicy"] == "Parallel"
    nodes = sts["spec"]["replicas"]
    script = main_container(docs, "trainer")["args"][0]
    flags = dict(re.findall(r"--([a-z-]+)=(\S+)", script))
    assert int(flags["nnodes"]) == nodes == 2
    assert cfg.trainer.distributed.world_size == nodes * int(flags["nproc-per-node"]) == 8
    assert flags["rdzv-backend"] == "c10d"
    headless = service(docs, sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    rdzv_port = next(p["port"] for p in headless["spec"]["ports"] if p["name"] == "rendezvous")
    assert flags["rdzv-endpoint"] == f"{sts['metadata']['name']}-0.{headless['metadata']['name']}:{rdzv_port}"
    assert f"-m relayrl.cli serve trainer {CONFIG_PATH}" in script and "exec python -m torch.distributed.run" in script
    # rank 0 (pod 0) serves the status API, so the trainer Service selects pod 0 only
    trainer_host = cfg.trainer.server.address.rpartition(":")[0]
    selector = service(docs, trainer_host)["spec"]["selector"]
    assert selector["statefulset.kubernetes.io/pod-name"] == f"{sts['metadata']['name']}-0"


def test_single_pod_trainer_runs_torchrun_standalone_for_several_ranks(tmp_path: Path) -> None:
    docs = rendered("small-cpu")
    container = main_container(docs, "trainer")
    assert container["command"] == ["python", "-m", "torch.distributed.run"]
    assert container["args"][:2] == ["--standalone", "--nproc-per-node=2"]
    assert container["args"][-5:] == ["-m", "relayrl.cli", "serve", "trainer", CONFIG_PATH]
    assert load_config(docs, tmp_path).trainer.distributed.world_size == 2
    assert workload(docs, "trainer")["spec"]["replicas"] == 1


def test_multinode_trainer_gets_a_read_write_once_volume_per_pod() -> None:
    sts = workload(render({"trainer": {"nodes": 2}}), "trainer")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]  # no shared storage: rank 0 owns checkpoints
    docs = render({"trainer": {"nodes": 2, "persistence": {"existingClaim": "shared"}}})
    volumes = workload(docs, "trainer")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "output", "persistentVolumeClaim": {"claimName": "shared"}} in volumes
    assert "volumeClaimTemplates" not in workload(docs, "trainer")["spec"]


def test_single_pod_trainer_keeps_checkpoints_on_its_own_volume() -> None:
    sts = workload(rendered("default"), "trainer")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "output" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    mounts = main_container(rendered("default"), "trainer")["volumeMounts"]
    assert {"name": "output", "mountPath": "/runs"} in mounts


# -- GPUs ----------------------------------------------------------------------------------------------------------

def test_gpu_values_request_gpus_for_inference_and_every_trainer_rank() -> None:
    docs = rendered("multinode-gpu")
    for svc, count in (("inference", 1), ("trainer", 4)):
        resources = main_container(docs, svc)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == count and resources["requests"]["nvidia.com/gpu"] == count
    for name in ("default", "small-cpu"):
        for spec in pod_specs(rendered(name)).values():
            for container in spec["containers"]:
                assert "nvidia.com/gpu" not in str(container.get("resources")), name


@pytest.mark.parametrize("values", [
    {"config": {"model": {"device": "cuda"}}},
    {"inference": {"gpu": True}},
    {"config": {"model": {"device": "cuda"}}, "inference": {"gpu": True}},
])
def test_device_and_gpu_requests_must_agree(values: dict[str, Any]) -> None:
    assert "gpu" in render_error(values)


# -- Redis ---------------------------------------------------------------------------------------------------------

def test_redis_statefulset_is_pinned_durable_and_on_a_volume() -> None:
    sts = workload(rendered("default"), "redis")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    image = container["image"]
    assert re.fullmatch(r"redis:\d+\.\d+\.\d+[-\w]*", image), image
    args = container["args"]
    for flag, value in (("--appendonly", "yes"), ("--appendfsync", "everysec"), ("--maxmemory-policy", "noeviction")):
        assert args[args.index(flag) + 1] == value, args
    assert args[args.index("--dir") + 1] == "/data"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container["volumeMounts"]


def test_external_redis_url_disables_the_statefulset(tmp_path: Path) -> None:
    docs = render({"redis": {"external": {"url": "rediss://redis.example.com:6380/2"}}})
    assert not [d for d in docs if component(d) == "redis"]
    assert load_config(docs, tmp_path).redis.url == "rediss://redis.example.com:6380/2"


def test_external_redis_secret_passes_url_and_password_in_the_environment_only(tmp_path: Path) -> None:
    docs = rendered("external-redis")
    assert not [d for d in docs if component(d) == "redis"]
    assert load_config(docs, tmp_path).redis.url == ""  # the services read RELAYRL_REDIS_URL (redis.url_env)
    for svc in ("rollout", "trainer"):
        container = main_container(docs, svc)
        env = {e["name"]: e for e in container["env"]}
        assert env["RELAYRL_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "relayrl-redis", "key": "url"}
        assert env["RELAYRL_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "relayrl-redis",
                                                                              "key": "password"}
        assert "redis" not in " ".join([*container.get("command", []), *container["args"]]).lower(), svc
    for svc in ("reward", "inference"):  # they never talk to Redis
        assert not [e for e in main_container(docs, svc)["env"] if e["name"].startswith("RELAYRL_REDIS")], svc
    (policy,) = [p for p in objects(docs, "NetworkPolicy") if component(p) == "rollout"]
    assert {"ipBlock": {"cidr": "10.20.0.0/16"}} in [peer for rule in policy["spec"]["egress"]
                                                       for peer in rule.get("to", [])]


# -- pods: security, probes, config mount --------------------------------------------------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_pod_is_restricted_and_mounts_no_service_account_token(name: str) -> None:
    docs = rendered(name)
    specs = pod_specs(docs)
    assert len(specs) >= 5
    for where, spec in specs.items():
        assert spec["automountServiceAccountToken"] is False, where
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True and pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert pod_sc["runAsUser"] > 0, where
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (where, container["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (where, container["name"])
            assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert sc.get("privileged", False) is False, where
    for account in objects(docs, "ServiceAccount"):
        assert account["automountServiceAccountToken"] is False


@pytest.mark.parametrize("name", ["default", "small-cpu"])
def test_services_have_native_grpc_probes_on_their_port_and_health_name(name: str) -> None:
    docs = rendered(name)
    for svc in SERVICES:
        container = main_container(docs, svc)
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"] == {"port": port, "service": HEALTH_NAMES[svc]}, (svc, probe)


def test_multinode_trainer_probes_rank_zero_health_on_pod_zero_only() -> None:
    container = main_container(rendered("multinode-gpu"), "trainer")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["sh", "-c"], command
        assert '[ "${POD_NAME##*-}" != 0 ] || exec relayrl health --target 127.0.0.1:50054' in command[2]
        assert f"--service {HEALTH_NAMES['trainer']}" in command[2]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_each_service_serves_itself_with_the_mounted_configmap(name: str) -> None:
    docs = rendered(name)
    (cm,) = objects(docs, "ConfigMap")
    for svc in SERVICES:
        spec = workload(docs, svc)["spec"]["template"]["spec"]
        container = main_container(docs, svc)
        command = [*container.get("command", []), *container["args"]]
        assert f"serve {svc} {CONFIG_PATH}" in " ".join(command), (svc, command)
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(Path(CONFIG_PATH).parent))
        assert mount["readOnly"] is True
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == cm["metadata"]["name"]


def test_helm_test_pod_checks_each_service_health_through_its_service(tmp_path: Path) -> None:
    docs = rendered("default")
    cfg = load_config(docs, tmp_path)
    (pod,) = objects(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["args"][0]
    for svc in SERVICES:
        address = getattr(cfg, svc).server.address
        assert f"relayrl health --target {address} --service {HEALTH_NAMES[svc]}" in script, svc


# -- NetworkPolicy and disruption budgets --------------------------------------------------------------------------

def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _allowed_from(policy: Manifest, port: int) -> set[str]:
    return {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            for rule in policy["spec"]["ingress"] if any(p["port"] == port for p in rule.get("ports", []))
            for peer in rule["from"] if "podSelector" in peer}


def _reaching(policy: Manifest, port: int) -> set[str]:
    """Who may reach ``port``: rules naming it and rules naming no port at all (every port); any non-pod peer
    (a namespace or an IP block) counts as "outside"."""
    rules = [r for r in policy["spec"]["ingress"] if "ports" not in r or any(p["port"] == port for p in r["ports"])]
    return {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] if "podSelector" in peer
            and "namespaceSelector" not in peer else "outside"
            for rule in rules for peer in rule.get("from", [{"ipBlock": {"cidr": "0.0.0.0/0"}}])}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_network_policy_denies_by_default_and_allows_only_the_service_flows(name: str) -> None:
    docs = rendered(name)
    policies = objects(docs, "NetworkPolicy")
    deny = [p for p in policies if "ingress" not in p["spec"] and "egress" not in p["spec"]]
    assert len(deny) == 1 and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    selector = deny[0]["spec"]["podSelector"]["matchLabels"]
    for where, labels in [(k, d["spec"]["template"]["metadata"]["labels"]) for k, d in
                          ((f"{d['kind']}/{d['metadata']['name']}", d) for d in docs if d["kind"] in WORKLOADS)] + \
            [(f"Pod/{p['metadata']['name']}", p["metadata"]["labels"]) for p in objects(docs, "Pod")]:
        assert _selects(selector, labels), f"{where} escapes the default deny"
    by_component = {component(p): p for p in policies if component(p)}
    values = merged(_chart().values, value_set(name))
    assert _allowed_from(by_component["inference"], values["inference"]["port"]) == {"rollout", "trainer", "test"}
    assert _reaching(by_component["inference"], values["inference"]["weightsPort"]) == {"trainer"}
    assert _allowed_from(by_component["reward"], values["reward"]["port"]) == {"rollout", "test"}
    assert _allowed_from(by_component["trainer"], values["trainer"]["port"]) == {"rollout", "test"}
    assert _allowed_from(by_component["rollout"], values["rollout"]["port"]) == {"test"}
    if "redis" in by_component:
        assert _allowed_from(by_component["redis"], values["redis"]["port"]) == {"rollout", "trainer"}
        assert by_component["redis"]["spec"]["egress"] == []
    assert by_component["inference"]["spec"]["egress"] == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_disruption_budgets_protect_the_trainer_and_replicated_rewards_only(name: str) -> None:
    docs = rendered(name)
    budgets = {component(p): p for p in objects(docs, "PodDisruptionBudget")}
    assert budgets["trainer"]["spec"]["maxUnavailable"] == 0
    values = merged(_chart().values, value_set(name))
    reward = values["reward"]
    most = reward["autoscaling"]["maxReplicas"] if reward["autoscaling"]["enabled"] else reward["replicas"]
    replicated = most > 1
    assert ("reward" in budgets) == replicated
    assert set(budgets) <= {"trainer", "reward"}
    hpa = objects(docs, "HorizontalPodAutoscaler")
    assert bool(hpa) == reward["autoscaling"]["enabled"]
    if hpa:
        assert "replicas" not in workload(docs, "reward")["spec"]


def _secret_env(container: Manifest) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}


def test_credentials_come_from_a_secret_and_reach_only_the_services_that_need_them() -> None:
    docs = render({})
    (secret,) = [d for d in objects(docs, "Secret") if d["metadata"]["name"].endswith("-credentials")]
    assert set(secret["data"]) == {"control-token", "weights-token", "redis-password"}
    name = secret["metadata"]["name"]

    wanted = {"inference": {"RELAYRL_WEIGHTS_TOKEN"},
              "trainer": {"RELAYRL_CONTROL_TOKEN", "RELAYRL_WEIGHTS_TOKEN", "RELAYRL_REDIS_PASSWORD"},
              "rollout": {"RELAYRL_CONTROL_TOKEN", "RELAYRL_REDIS_PASSWORD"}, "reward": set()}
    for svc, names in wanted.items():
        env = _secret_env(main_container(docs, svc))
        assert set(env) == names, svc
        assert all(env[k][0] == name for k in names)
    assert all("token" not in " ".join(main_container(docs, svc).get("args", [])).lower() for svc in wanted)


def test_an_existing_credentials_secret_replaces_the_generated_one() -> None:
    docs = render({"credentials": {"existingSecret": "my-tokens"}})

    assert not [d for d in objects(docs, "Secret") if d["metadata"]["name"].endswith("-credentials")]
    assert _secret_env(main_container(docs, "trainer"))["RELAYRL_WEIGHTS_TOKEN"] == ("my-tokens", "weights-token")

