"""Rendering charts/relayrl offline for the deploy tests: value sets, rendered objects, lookups, the loaded config."""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from relayrl.common.pb import inference_pb2, reward_pb2, rollout_pb2, trainer_pb2
from relayrl.config import RunConfig, load_run_config
from tests.conftest import REPO

CHART = REPO / "charts" / "relayrl"
VALUE_SETS = ("default", "small-cpu", "multinode-gpu", "external-redis")
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
RELEASE, NAMESPACE = "rl", "ml"
# run.id is required; renders that do not test it get this one (``{"run": {"id": ""}}`` renders without one)
RUN_ID = "test-run"
CONFIG_PATH = "/config/relayrl.yaml"
HEALTH_NAMES = {
    "inference": inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,
    "reward": reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name,
    "rollout": rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name,
    "trainer": trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name,
}
WORKLOADS = ("Deployment", "StatefulSet", "Job")
# prometheus-operator kinds: no schema in kubernetes-validate (their structure is checked in test_helm_monitoring)
CRD_KINDS = ("ServiceMonitor", "PodMonitor")

Manifest = dict[str, Any]
OFFLINE = {"credentials": {"generateOffline": True}}  # these renders see no cluster (helm_python renders offline)


def value_set(name: str) -> dict[str, Any]:
    """The values of set ``name`` as these offline renders and lints use them (OFFLINE)."""
    if name == "default":
        return merged(OFFLINE, {"run": {"id": RUN_ID}})  # the chart's defaults and the one value it requires
    data = yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())
    assert isinstance(data, dict)
    return merged(OFFLINE, data)


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render(values: dict[str, Any]) -> list[Manifest]:
    values = values if "run" in values else {**values, "run": {"id": RUN_ID}}
    values = merged(OFFLINE, values)
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
    specs = {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"] for d in docs if d["kind"] in WORKLOADS
    }
    specs.update({f"Pod/{d['metadata']['name']}": d["spec"] for d in objects(docs, "Pod")})
    return specs


def main_container(docs: list[Manifest], svc: str) -> Manifest:
    (container,) = [c for c in workload(docs, svc)["spec"]["template"]["spec"]["containers"] if c["name"] == svc]
    return container


def config_text(docs: list[Manifest]) -> str:
    (cm,) = [d for d in objects(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    return str(cm["data"]["relayrl.yaml"])


def load_config(docs: list[Manifest], tmp_path: Path) -> RunConfig:
    path = tmp_path / "relayrl.yaml"
    path.write_text(config_text(docs))
    return load_run_config(path)


def checksums(docs: list[Manifest]) -> dict[str, str]:
    return {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        for d in docs
        if d["kind"] in WORKLOADS and component(d) not in ("redis", "model-fill")
    }


def render_error(values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmError) as info:
        render(values)
    return str(info.value)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def allowed_from(policy: Manifest, port: int) -> set[str]:
    return {
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for rule in policy["spec"]["ingress"]
        if any(p["port"] == port for p in rule.get("ports", []))
        for peer in rule["from"]
        if "podSelector" in peer
    }


def reaching(policy: Manifest, port: int) -> set[str]:
    """Who may reach ``port``: rules naming it and rules naming no port at all (every port); any non-pod peer
    (a namespace or an IP block) counts as "outside"."""
    rules = [r for r in policy["spec"]["ingress"] if "ports" not in r or any(p["port"] == port for p in r["ports"])]
    return {
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        if "podSelector" in peer and "namespaceSelector" not in peer
        else "outside"
        for rule in rules
        for peer in rule.get("from", [{"ipBlock": {"cidr": "0.0.0.0/0"}}])
    }


def secret_env(container: Manifest) -> dict[str, tuple[str, str]]:
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
