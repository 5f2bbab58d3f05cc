"""The Helm chart's workloads: the trainer's torchrun wiring and volumes, GPUs, Redis, pod security, probes,
network policies, disruption budgets and credentials (rendered offline, see tests/deploy/chart.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from relayrl.cli import SERVICES
from tests.deploy.chart import (
    CONFIG_PATH,
    HEALTH_NAMES,
    VALUE_SETS,
    WORKLOADS,
    _chart,
    allowed_from,
    component,
    load_config,
    main_container,
    merged,
    objects,
    pod_specs,
    reaching,
    render,
    render_error,
    rendered,
    secret_env,
    selects,
    service,
    value_set,
    workload,
)

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


def test_single_pod_trainer_runs_torchrun_with_its_rendezvous_on_loopback_for_several_ranks(tmp_path: Path) -> None:
    docs = rendered("small-cpu")
    container = main_container(docs, "trainer")
    assert container["command"] == ["tini", "--", "sh", "-c"]
    script = container["args"][0]
    flags = dict(re.findall(r"--([a-z-]+)=(\S+)", script))
    assert (flags["nnodes"], flags["nproc-per-node"]) == ("1", "2")
    assert flags["rdzv-endpoint"] == "127.0.0.1:29400" and "local-addr" not in flags
    assert script.rstrip().endswith(f"-m relayrl.cli serve trainer {CONFIG_PATH}")
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


def test_a_sharded_multinode_trainer_needs_one_folder_every_pod_mounts() -> None:
    """dp_shard > 1: every rank writes its shards into one checkpoint folder and reads the others' on a resume, so
    per-pod volumes are refused (naming the field and the fix); shared gives one ReadWriteMany claim to every pod."""
    sharded = {"config": {"trainer": {"distributed": {"dp_shard": 2}}}, "trainer": {"nodes": 2}}
    message = render_error(sharded)
    assert "config.trainer.distributed.dp_shard (2)" in message and "trainer.persistence.shared=true" in message
    assert "dp_shard" in render_error(merged(sharded, {"trainer": {"persistence": {"enabled": False}}}))

    docs = render(merged(sharded, {"trainer": {"persistence": {"shared": True, "storageClassName": "nfs"}}}))
    sts = workload(docs, "trainer")
    (claim,) = [c for c in objects(docs, "PersistentVolumeClaim") if c["metadata"]["name"].endswith("trainer-output")]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["storageClassName"] == "nfs"
    volumes = sts["spec"]["template"]["spec"]["volumes"]
    assert {"name": "output", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in volumes
    assert "volumeClaimTemplates" not in sts["spec"]
    assert render(merged(sharded, {"trainer": {"persistence": {"existingClaim": "rwx"}}}))  # the user's own claim


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


@pytest.mark.parametrize(
    "values",
    [
        {"config": {"model": {"device": "cuda"}}},
        {"inference": {"gpu": True}},
        {"config": {"model": {"device": "cuda"}}, "inference": {"gpu": True}},
    ],
)
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
        assert env["RELAYRL_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "relayrl-redis",
            "key": "password",
        }
        assert "redis" not in " ".join([*container.get("command", []), *container["args"]]).lower(), svc
    for svc in ("reward", "inference"):  # they never talk to Redis
        assert not [e for e in main_container(docs, svc)["env"] if e["name"].startswith("RELAYRL_REDIS")], svc
    (policy,) = [p for p in objects(docs, "NetworkPolicy") if component(p) == "rollout"]
    assert {"ipBlock": {"cidr": "10.20.0.0/16"}} in [
        peer for rule in policy["spec"]["egress"] for peer in rule.get("to", [])
    ]


# -- pods: security, probes, config mount --------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_pod_is_restricted_and_mounts_no_service_account_token(name: str) -> None:
    docs = rendered(name)
    values = merged(_chart().values, value_set(name))
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
            added = values[where.rsplit("-", 1)[-1]].get("capabilitiesAdd", []) if container["name"] in SERVICES else []
            assert sc["capabilities"] == {"drop": ["ALL"], **({"add": added} if added else {})}, where
            assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert sc.get("privileged", False) is False, where
    for account in objects(docs, "ServiceAccount"):
        assert account["automountServiceAccountToken"] is False


@pytest.mark.parametrize("name", ["default", "small-cpu"])
def test_services_have_native_grpc_probes_on_their_port_and_health_name(name: str) -> None:
    docs = rendered(name)
    trainer = merged(_chart().values, value_set(name))["trainer"]
    torchrun = trainer["nodes"] * trainer["nprocPerNode"] > 1  # probes on the agent (test_helm_lifecycle)
    for svc in (s for s in SERVICES if not (s == "trainer" and torchrun)):
        container = main_container(docs, svc)
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"] == {"port": port, "service": HEALTH_NAMES[svc]}, (svc, probe)


def test_multinode_trainer_is_ready_when_rank_zero_serves_on_pod_zero() -> None:
    container = main_container(rendered("multinode-gpu"), "trainer")
    command = container["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["sh", "-c"], command
    assert '[ "${POD_NAME##*-}" != 0 ] || exec relayrl health --target 127.0.0.1:50054' in command[2]
    assert f"--service {HEALTH_NAMES['trainer']}" in command[2]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_each_service_serves_itself_with_the_mounted_configmap(name: str) -> None:
    docs = rendered(name)
    (cm,) = [d for d in objects(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
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


@pytest.mark.parametrize("name", VALUE_SETS)
def test_network_policy_denies_by_default_and_allows_only_the_service_flows(name: str) -> None:
    docs = rendered(name)
    policies = objects(docs, "NetworkPolicy")
    deny = [p for p in policies if "ingress" not in p["spec"] and "egress" not in p["spec"]]
    assert len(deny) == 1 and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    selector = deny[0]["spec"]["podSelector"]["matchLabels"]
    for where, labels in [
        (k, d["spec"]["template"]["metadata"]["labels"])
        for k, d in ((f"{d['kind']}/{d['metadata']['name']}", d) for d in docs if d["kind"] in WORKLOADS)
    ] + [(f"Pod/{p['metadata']['name']}", p["metadata"]["labels"]) for p in objects(docs, "Pod")]:
        assert selects(selector, labels), f"{where} escapes the default deny"
    by_component = {component(p): p for p in policies if component(p)}
    values = merged(_chart().values, value_set(name))
    assert allowed_from(by_component["inference"], values["inference"]["port"]) == {"rollout", "trainer", "test"}
    assert reaching(by_component["inference"], values["inference"]["weightsPort"]) == {"trainer"}
    assert allowed_from(by_component["reward"], values["reward"]["port"]) == {"rollout", "test"}
    assert allowed_from(by_component["trainer"], values["trainer"]["port"]) == {"rollout", "test"}
    assert allowed_from(by_component["rollout"], values["rollout"]["port"]) == {"test"}
    if "redis" in by_component:
        assert allowed_from(by_component["redis"], values["redis"]["port"]) == {"rollout", "trainer"}
        assert by_component["redis"]["spec"]["egress"] == []
    assert by_component["inference"]["spec"]["egress"] == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_disruption_budgets_never_block_a_drain_and_cover_replicated_rewards_only(name: str) -> None:
    docs = rendered(name)
    budgets = {component(p): p for p in objects(docs, "PodDisruptionBudget")}
    assert "trainer" not in budgets  # off by default: no budget can protect a torchrun group (test_helm_lifecycle)
    for budget in budgets.values():
        assert budget["spec"]["maxUnavailable"] >= 1
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
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


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rollout_reaches_reward_through_a_headless_service_of_every_ready_pod_and_resolves_it_again(
    name: str, tmp_path: Path
) -> None:
    """Rollout's reward client balances over the addresses its target resolves to: the headless Service lists every
    ready reward pod (so an HPA's added pods get work), and a bounded connection age makes clients resolve again."""
    docs = rendered(name)
    headless = service(docs, "rl-relayrl-reward-pods")
    assert headless["spec"]["clusterIP"] == "None" and not headless["spec"].get("publishNotReadyAddresses")
    assert selects(headless["spec"]["selector"], workload(docs, "reward")["spec"]["template"]["metadata"]["labels"])
    port = merged(_chart().values, value_set(name))["reward"]["port"]
    assert [p["port"] for p in headless["spec"]["ports"]] == [port]
    cfg = load_config(docs, tmp_path)
    assert cfg.reward.server.target == f"rl-relayrl-reward-pods:{port}"
    assert cfg.reward.server.max_connection_age_s > 0


def test_credentials_come_from_a_secret_and_reach_only_the_services_that_need_them() -> None:
    docs = render({})
    (secret,) = [d for d in objects(docs, "Secret") if d["metadata"]["name"].endswith("-credentials")]
    assert set(secret["data"]) == {"control-token", "weights-token", "code-token", "redis-password"}
    name = secret["metadata"]["name"]

    wanted = {
        "inference": {"RELAYRL_WEIGHTS_TOKEN"},
        "trainer": {"RELAYRL_CONTROL_TOKEN", "RELAYRL_WEIGHTS_TOKEN", "RELAYRL_REDIS_PASSWORD"},
        "rollout": {"RELAYRL_CONTROL_TOKEN", "RELAYRL_CODE_TOKEN", "RELAYRL_REDIS_PASSWORD"},
        "reward": {"RELAYRL_CODE_TOKEN"},
    }
    for svc, names in wanted.items():
        env = secret_env(main_container(docs, svc))
        assert set(env) == names, svc
        assert all(env[k][0] == name for k in names)
    assert all("token" not in " ".join(main_container(docs, svc).get("args", [])).lower() for svc in wanted)


def test_an_existing_credentials_secret_replaces_the_generated_one() -> None:
    docs = render({"credentials": {"existingSecret": "my-tokens"}})

    assert not [d for d in objects(docs, "Secret") if d["metadata"]["name"].endswith("-credentials")]
    assert secret_env(main_container(docs, "trainer"))["RELAYRL_WEIGHTS_TOKEN"] == ("my-tokens", "weights-token")
    assert secret_env(main_container(docs, "reward"))["RELAYRL_CODE_TOKEN"] == ("my-tokens", "code-token")


def test_code_token_of_an_existing_secret_is_optional_but_the_generated_secret_always_has_it() -> None:
    def code_token_ref(values: dict[str, Any], svc: str) -> dict[str, Any]:
        env = main_container(render(values), svc)["env"]
        (ref,) = [e["valueFrom"]["secretKeyRef"] for e in env if e["name"] == "RELAYRL_CODE_TOKEN"]
        return dict(ref)

    for svc in ("reward", "rollout"):
        # a Secret made for an older chart lacks code-token: the pods still start, and RunCode stays refused
        assert code_token_ref({"credentials": {"existingSecret": "my-tokens"}}, svc)["optional"] is True
        assert "optional" not in code_token_ref({}, svc)  # the chart's own Secret: a missing key fails loudly
