"""What the Helm chart does with secrets and exposure: no secret in any container argument (nor a `$(VAR)` of a
secret variable, which kubelet expands onto the command line), Redis's password from the credentials Secret,
inference's weights port in the config, container and Service, reachable by trainer pods only, and a reward pod
without training data. Renders offline like test_helm.py (helm-python-sdk), with its helpers."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tests.deploy.chart import (
    VALUE_SETS,
    Manifest,
    _chart,
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
    service,
    value_set,
    workload,
)


def _secret_values(docs: list[Manifest]) -> list[str]:
    return [base64.b64decode(v).decode() for d in objects(docs, "Secret") for v in d.get("data", {}).values()]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_container_argument_holds_or_expands_a_secret(name: str) -> None:
    docs = rendered(name)
    values = _secret_values(docs)
    assert values, name  # the generated credentials Secret
    for where, spec in pod_specs(docs).items():
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            argv = " ".join([*container.get("command", []), *container.get("args", [])])
            assert not [v for v in values if v in argv], (where, container["name"])
            # kubelet expands $(VAR) in command and args: a secret's variable there would be on the command line
            secret_vars = secret_env(container)
            assert not [v for v in secret_vars if f"$({v})" in argv], (where, container["name"])
            probes = " ".join(str(container.get(p, "")) for p in ("startupProbe", "livenessProbe", "readinessProbe"))
            assert not [v for v in values if v in probes], (where, container["name"])


def test_redis_requires_the_password_of_the_credentials_secret() -> None:
    docs = rendered("default")
    (secret,) = [d for d in objects(docs, "Secret") if d["metadata"]["name"].endswith("-credentials")]
    (container,) = workload(docs, "redis")["spec"]["template"]["spec"]["containers"]

    assert secret_env(container) == {"REDISCLI_AUTH": (secret["metadata"]["name"], "redis-password")}
    script = container["command"][2]
    assert container["command"][:2] == ["sh", "-c"] and 'exec redis-server "$@" -' in script
    assert 'requirepass "$REDISCLI_AUTH"' in script  # config on stdin, from the environment
    assert len(base64.b64decode(secret["data"]["redis-password"])) >= 32
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):  # NOAUTH must not count as healthy
        assert container[probe]["exec"]["command"] == ["sh", "-c", "redis-cli -p 6379 ping | grep -qx PONG"]


def test_an_existing_credentials_secret_also_holds_the_redis_password() -> None:
    docs = render({"credentials": {"existingSecret": "my-tokens"}})

    (container,) = workload(docs, "redis")["spec"]["template"]["spec"]["containers"]
    assert secret_env(container)["REDISCLI_AUTH"] == ("my-tokens", "redis-password")
    assert secret_env(main_container(docs, "rollout"))["RELAYRL_REDIS_PASSWORD"] == ("my-tokens", "redis-password")


def test_a_render_without_a_cluster_fails_clearly_instead_of_making_new_credentials_unless_a_secret_is_named() -> None:
    """helm template, Argo CD and --dry-run see no cluster: `lookup` finds nothing, so each such render would make
    new tokens and a new Redis password. It fails naming the fix; with existingSecret (GitOps) it renders, and
    generating anyway is an explicit choice."""
    values = {"run": {"id": "git-1"}}
    with pytest.raises(Exception, match=r"cannot see the cluster.*credentials.existingSecret") as info:
        _chart().render(values, name="rl", namespace="ns", is_install=True)
    assert "generateOffline" in str(info.value)

    gitops = _chart().render({**values, "credentials": {"existingSecret": "rl-tokens"}}, name="rl", namespace="ns")
    assert "kind: Secret\n" not in gitops.get("relayrl/templates/credentials.yaml", "")
    generated = _chart().render({**values, "credentials": {"generateOffline": True}}, name="rl", namespace="ns")
    assert "control-token:" in generated["relayrl/templates/credentials.yaml"]


def test_external_redis_url_with_credentials_is_refused() -> None:
    message = render_error({"redis": {"external": {"url": "redis://:hunter2@redis.example.com:6379/0"}}})

    assert "redis.external.url holds credentials" in message
    assert "hunter2" not in message


@pytest.mark.parametrize("name", VALUE_SETS)
def test_weights_port_is_in_the_config_container_and_service(name: str, tmp_path: Path) -> None:
    docs = rendered(name)
    cfg = load_config(docs, tmp_path)
    port = merged(_chart().values, value_set(name))["inference"]["weightsPort"]

    weights = cfg.inference.weights_server
    assert (weights.host, weights.port) == ("0.0.0.0", port)
    host, _, address_port = weights.address.rpartition(":")
    assert int(address_port) == port and port != cfg.inference.server.port
    assert {"name": "weights", "containerPort": port, "protocol": "TCP"} in main_container(docs, "inference")["ports"]
    assert port in [p["port"] for p in service(docs, host)["spec"]["ports"]]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_reward_pod_mounts_no_training_data_models_or_writable_volume(name: str) -> None:
    spec = workload(rendered(name), "reward")["spec"]["template"]["spec"]
    (container,) = spec["containers"]

    assert {v["name"] for v in spec["volumes"]} == {"config", "tmp"}
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/config", "/tmp"}
    assert not [v for v in spec["volumes"] if "persistentVolumeClaim" in v]


def test_extra_inference_ingress_without_ports_does_not_open_the_weights_port() -> None:
    clients = {"from": [{"namespaceSelector": {"matchLabels": {"team": "eval"}}}]}
    docs = render({"networkPolicy": {"extraIngress": {"inference": [clients]}}})
    (policy,) = [p for p in objects(docs, "NetworkPolicy") if component(p) == "inference"]

    assert reaching(policy, 50051) == {"rollout", "trainer", "test", "outside"}
    assert reaching(policy, 8000) == {"outside"}
    assert reaching(policy, 50055) == {"trainer"}


@pytest.mark.parametrize("port", [50051, 8000])
def test_weights_port_must_differ_from_the_client_ports(port: int) -> None:
    assert "inference.weightsPort must differ" in render_error({"inference": {"weightsPort": port}})
