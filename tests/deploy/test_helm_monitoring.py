"""Monitoring (metrics ports open to a monitoring namespace, Service/PodMonitor, Redis exporter, the Grafana
dashboard checked against the series the services really export) and the GPU-cluster pod knobs, rendered offline."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.deploy.chart import CHART, main_container, objects, render, render_error, workload
from tests.metrics_series import exported_series

MON_NS = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
HTTP_PORTS = {"inference": 8000, "reward": 8002, "rollout": 8003, "trainer": 8004}
DASHBOARD = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())


def _policies(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"].removeprefix("rl-relayrl-"): p for p in objects(docs, "NetworkPolicy")}


def _scrapers(policy: dict[str, Any], port: int) -> list[dict[str, Any]]:
    return [
        peer
        for rule in policy["spec"]["ingress"]
        if any(p["port"] == port for p in rule.get("ports", []))
        for peer in rule["from"]
        if "namespaceSelector" in peer
    ]


def test_metrics_ports_open_to_the_monitoring_namespace_only_and_only_when_one_is_named() -> None:
    closed = _policies(render({}))
    assert all(not _scrapers(closed[svc], port) for svc, port in HTTP_PORTS.items())
    docs = render(
        {
            "monitoring": {"namespaceSelector": MON_NS, "podSelector": {"matchLabels": {"app": "prom"}}},
            "redis": {"exporter": {"enabled": True}},
        }
    )
    policies = _policies(docs)
    for svc, port in {**HTTP_PORTS, "redis": 9121}.items():
        assert _scrapers(policies[svc], port) == [
            {"namespaceSelector": MON_NS, "podSelector": {"matchLabels": {"app": "prom"}}}
        ], svc
    # the gRPC and weights ports stay closed to it
    assert not _scrapers(policies["inference"], 50055) and not _scrapers(policies["trainer"], 50054)


def test_reward_serves_metrics_on_its_http_port_in_config_container_and_service(tmp_path: Any) -> None:
    from tests.deploy.chart import load_config, service

    docs = render({})
    assert load_config(docs, tmp_path).reward.http.port == 8002
    assert {"name": "http", "containerPort": 8002, "protocol": "TCP"} in main_container(docs, "reward")["ports"]
    assert 8002 in [p["port"] for p in service(docs, "rl-relayrl-reward")["spec"]["ports"]]


def test_service_and_pod_monitors_scrape_every_component_when_enabled() -> None:
    assert not objects(render({}), "ServiceMonitor") and not objects(render({}), "PodMonitor")
    docs = render(
        {
            "monitoring": {
                "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                "podMonitor": {"enabled": True},
            },
            "redis": {"exporter": {"enabled": True}},
        }
    )
    (sm,) = objects(docs, "ServiceMonitor")
    (pm,) = objects(docs, "PodMonitor")
    assert sm["metadata"]["labels"]["release"] == "kps"
    for monitor in (sm, pm):
        (expr,) = monitor["spec"]["selector"]["matchExpressions"]
        assert set(expr["values"]) == {"inference", "reward", "rollout", "trainer", "redis"}
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["http", "metrics"]
    services = {s["metadata"]["name"]: s for s in objects(docs, "Service")}
    for svc in ("inference", "reward", "rollout", "trainer", "redis"):
        assert "http" in [p["name"] for p in services[f"rl-relayrl-{svc}"]["spec"]["ports"]], svc


def test_the_pod_monitor_scrapes_trainer_pod_zero_only_where_rank_zero_serves_metrics() -> None:
    """Only trainer rank 0 (on pod 0) serves HTTP: the PodMonitor drops the trainer's other pods, which would be
    targets that are always down, and keeps every pod of the other services."""
    docs = render({"trainer": {"nodes": 4}, "monitoring": {"podMonitor": {"enabled": True}}})
    (pm,) = objects(docs, "PodMonitor")
    (http,) = [e for e in pm["spec"]["podMetricsEndpoints"] if e["port"] == "http"]

    def scraped(component: str, pod: str) -> bool:  # Prometheus's relabeling: join the source labels, match fully
        for rule in http.get("relabelings", []):
            value = rule["separator"].join(
                {"component": component, "pod": pod}[_label(s)] for s in rule["sourceLabels"]
            )
            if rule["action"] == "drop" and re.fullmatch(rule["regex"], value):
                return False
        return True

    trainer_pods = [p["metadata"]["name"] for p in _trainer_pods(docs)]
    assert [scraped("trainer", pod) for pod in trainer_pods] == [True, False, False, False]
    assert all(scraped(c, f"rl-relayrl-{c}-{i}") for c in ("inference", "reward", "rollout") for i in (0, 1, 10))


def _label(source: str) -> str:
    return {"__meta_kubernetes_pod_label_app_kubernetes_io_component": "component"}.get(source, "pod")


def _trainer_pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sts = workload(docs, "trainer")
    name = sts["metadata"]["name"]
    return [{"metadata": {"name": f"{name}-{i}"}} for i in range(sts["spec"]["replicas"])]


def test_the_redis_exporter_authenticates_from_the_secret_and_the_redis_image_can_be_pinned_by_digest() -> None:
    digest = "sha256:" + "1" * 64
    docs = render({"redis": {"exporter": {"enabled": True}, "image": {"digest": digest}}})
    containers = {c["name"]: c for c in workload(docs, "redis")["spec"]["template"]["spec"]["containers"]}
    assert containers["redis"]["image"] == f"redis@{digest}"
    env = {e["name"]: e for e in containers["exporter"]["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    assert "value" not in env["REDIS_PASSWORD"]
    assert "/redis/image/digest" in render_error({"redis": {"image": {"digest": "sha256:abc"}}})


# -- the Grafana dashboard ------------------------------------------------------------------------------------------


def test_the_dashboard_covers_the_key_metrics_with_series_the_services_export() -> None:
    exported = exported_series()
    titles = {p["title"] for p in DASHBOARD["panels"]}
    assert {"Throughput", "Staleness", "Queue lag", "Reward", "Weight sync"} <= titles
    for panel in DASHBOARD["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\brelayrl_[a-z_]+\b", target["expr"]))
            assert names and names <= exported, (panel["title"], sorted(names - exported))


def test_the_dashboard_is_well_formed_and_shipped_by_the_chart() -> None:
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    used = {v for p in DASHBOARD["panels"] for t in p["targets"] for v in re.findall(r"\$(\w+)", t["expr"])}
    assert used - {"__rate_interval"} <= variables
    for panel in DASHBOARD["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    (cm,) = [
        c
        for c in objects(render({"monitoring": {"grafanaDashboard": {"enabled": True}}}), "ConfigMap")
        if c["metadata"]["name"].endswith("-dashboard")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["relayrl.json"]) == DASHBOARD


# -- GPU-cluster pod knobs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [("runtimeClassName", "nvidia"), ("priorityClassName", "training-high"), ("schedulerName", "volcano")],
)
@pytest.mark.parametrize("svc", ["inference", "trainer", "reward", "rollout"])
def test_scheduling_names_reach_the_pod_spec(svc: str, key: str, value: str) -> None:
    spec = workload(render({svc: {key: value}}), svc)["spec"]["template"]["spec"]
    assert spec[key] == value
    assert key not in workload(render({}), svc)["spec"]["template"]["spec"]


def test_extra_pod_labels_and_annotations_reach_the_pod_template_only() -> None:
    docs = render(
        {"trainer": {"podLabels": {"kueue.x-k8s.io/queue-name": "gpu"}, "podAnnotations": {"example.com/owner": "rl"}}}
    )
    sts = workload(docs, "trainer")
    assert sts["spec"]["template"]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu"
    assert sts["spec"]["template"]["metadata"]["annotations"]["example.com/owner"] == "rl"
    assert "kueue.x-k8s.io/queue-name" not in sts["spec"]["selector"]["matchLabels"]  # selectors stay immutable


def test_topology_spread_defaults_to_the_components_own_pods() -> None:
    spread = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}
    docs = render({"trainer": {"nodes": 2, "topologySpreadConstraints": [spread]}})
    (rendered,) = workload(docs, "trainer")["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert rendered["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "trainer"
    assert {k: rendered[k] for k in spread} == spread
    assert "/trainer/topologySpreadConstraints/0" in render_error(
        {"trainer": {"topologySpreadConstraints": [{"maxSkew": 1}]}}
    )


def test_added_capabilities_keep_every_other_capability_dropped() -> None:
    docs = render({"trainer": {"capabilitiesAdd": ["IPC_LOCK"]}})
    assert main_container(docs, "trainer")["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert main_container(docs, "inference")["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "/trainer/capabilitiesAdd/0" in render_error({"trainer": {"capabilitiesAdd": ["ipc lock"]}})


def test_host_networking_is_opt_in_and_keeps_cluster_dns() -> None:
    spec = workload(render({"trainer": {"hostNetwork": True}}), "trainer")["spec"]["template"]["spec"]
    assert (spec["hostNetwork"], spec["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    assert "hostNetwork" not in workload(render({}), "trainer")["spec"]["template"]["spec"]
    assert "hostNetwork" in render_error({"reward": {"hostNetwork": True}})  # GPU services only
