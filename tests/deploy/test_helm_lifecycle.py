"""What a real cluster needs from the chart, rendered offline: the run's identity and lifecycle (a finished run
stays finished, budgets never block drains, config changes never mix in one torchrun group), rendezvous and
shutdown timing, liveness on the torchrun agent, and the model volume's access modes and filling."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import kubernetes_validate
import pytest

from tests.deploy.chart import (
    CRD_KINDS,
    KUBE_VERSIONS,
    checksums,
    config_text,
    load_config,
    main_container,
    objects,
    render,
    render_error,
    rendered,
    workload,
)

MULTI = {"trainer": {"nodes": 2}}
MODEL_PVC = {"createTiny": False, "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}}


def _flags(docs: list[dict[str, object]]) -> dict[str, str]:
    return dict(re.findall(r"--([a-z-]+)=\"?([^\s\"]+)", main_container(docs, "trainer")["args"][0]))


# -- the run's identity ----------------------------------------------------------------------------------------------


def test_a_release_without_a_run_id_is_refused_and_a_malformed_one_is_named() -> None:
    assert "run.id is required" in render_error({"run": {"id": ""}})
    assert "/run/id" in render_error({"run": {"id": "Run_1"}})  # the values schema


def test_the_run_id_names_the_output_directory_of_trainer_and_rollout(tmp_path: Path) -> None:
    docs = render({"run": {"id": "arith-002"}})
    cfg = load_config(docs, tmp_path)
    assert cfg.output_dir == Path("/runs/arith-002")
    for svc in ("trainer", "rollout"):
        mounts = {m["name"]: m["mountPath"] for m in main_container(docs, svc)["volumeMounts"]}
        assert cfg.output_dir.parent == Path(mounts["output"]), svc


def test_rollout_state_goes_to_a_kept_claim_of_its_own() -> None:
    docs = rendered("default")
    (claim,) = [c for c in objects(docs, "PersistentVolumeClaim") if c["metadata"]["name"].endswith("-rollout")]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    volumes = {v["name"]: v for v in workload(docs, "rollout")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["output"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    off = render({"rollout": {"persistence": {"enabled": False}}})
    assert not [c for c in objects(off, "PersistentVolumeClaim") if c["metadata"]["name"].endswith("-rollout")]


# -- lifecycle ---------------------------------------------------------------------------------------------------------


def test_the_trainer_stays_up_once_finished_and_the_chart_owns_that_setting(tmp_path: Path) -> None:
    assert load_config(rendered("default"), tmp_path).trainer.after_finish.value == "stay"
    assert "config.trainer.after_finish is set by the chart" in render_error(
        {"config": {"trainer": {"after_finish": "exit"}}}
    )


def test_no_trainer_budget_by_default_and_an_enabled_one_never_blocks_a_drain() -> None:
    assert not objects(render(MULTI), "PodDisruptionBudget")
    (budget,) = objects(render({"trainer": {"nodes": 2, "pdb": {"enabled": True}}}), "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_a_config_change_replaces_no_trainer_pod_and_gets_a_rendezvous_of_its_own() -> None:
    before = render(MULTI)
    after = render({**MULTI, "config": {"trainer": {"total_steps": 801}}})
    assert workload(before, "trainer")["spec"]["updateStrategy"] == {"type": "OnDelete"}
    name = workload(before, "trainer")["metadata"]["name"]
    ids = [_flags(docs)["rdzv-id"] for docs in (before, after)]
    assert ids[0] != ids[1] and all(i.startswith(f"{name}-") for i in ids)
    assert ids[0] == _flags(render(MULTI))["rdzv-id"]  # the same config: the same group across renders


def test_an_image_only_upgrade_gets_a_rendezvous_of_its_own_and_a_digest_pins_the_image() -> None:
    """An upgrade that changes the image alone keeps the config: were the image not in the rendezvous id, a
    new-image pod could join old-image pods in one torchrun group."""
    digest = "sha256:" + "ab" * 32
    ids = {tag: _flags(render({**MULTI, "image": {"tag": tag}}))["rdzv-id"] for tag in ("1.0", "1.1")}
    pinned = render({**MULTI, "image": {"tag": "1.0", "digest": digest}})
    assert ids["1.0"] != ids["1.1"] and _flags(pinned)["rdzv-id"] not in ids.values()
    assert ids["1.0"] == _flags(render({**MULTI, "image": {"tag": "1.0"}}))["rdzv-id"]
    for svc in ("inference", "reward", "rollout", "trainer"):
        assert main_container(pinned, svc)["image"] == f"relayrl@{digest}", svc
    assert "digest" in render_error({"image": {"digest": "latest"}})


@pytest.mark.parametrize("name", ["default", "multinode-gpu"])
def test_every_pod_knows_the_digest_of_the_config_it_was_created_for(name: str) -> None:
    docs = rendered(name)
    digest = hashlib.sha256(config_text(docs).rstrip("\n").encode()).hexdigest()  # what `relayrl serve` checks
    assert set(checksums(docs).values()) == {digest}
    for svc in ("inference", "reward", "rollout", "trainer"):
        env = {e["name"]: e.get("value") for e in main_container(docs, svc)["env"]}
        assert env["RELAYRL_CONFIG_SHA256"] == digest, svc


# -- rendezvous, shutdown, liveness ---------------------------------------------------------------------------------


def test_rendezvous_waits_for_a_late_pod_zero_and_the_agent_outlasts_a_checkpoint() -> None:
    docs = render(MULTI)
    flags = _flags(docs)
    conf = dict(kv.split("=") for kv in flags["rdzv-conf"].split(","))
    assert int(conf["read_timeout"]) >= int(conf["join_timeout"]) > 60  # torch's default read timeout: 60 s
    grace = workload(docs, "trainer")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert 30 < int(flags["shutdown-timeout"]) < grace  # torch's default 30 s would cut a checkpoint short
    assert main_container(docs, "trainer")["command"][:2] == ["tini", "--"]


def test_timeouts_that_contradict_each_other_are_refused() -> None:
    short_read = {"trainer": {"rendezvous": {"readTimeoutSeconds": 60}}}
    assert "readTimeoutSeconds (60) must be at least joinTimeoutSeconds (600)" in render_error(short_read)
    late_kill = {"trainer": {"shutdownTimeoutSeconds": 120}}
    assert "must be less than trainer.terminationGracePeriodSeconds (120)" in render_error(late_kill)


@pytest.mark.parametrize("trainer", [{"nodes": 2}, {"nprocPerNode": 2}])
def test_torchrun_liveness_checks_the_agents_store_not_rank_zeros_server(trainer: dict[str, int]) -> None:
    docs = render({"trainer": trainer})
    container = main_container(docs, "trainer")
    port = _flags(docs)["rdzv-endpoint"].rpartition(":")[2]
    for probe in ("startupProbe", "livenessProbe"):
        script = container[probe]["exec"]["command"][2]
        assert script.startswith('[ "${POD_NAME##*-}" != 0 ] || exec python -c')
        assert f"('127.0.0.1', {port})" in script and "relayrl health" not in script
    assert "relayrl health" in container["readinessProbe"]["exec"]["command"][2]


def test_a_single_process_trainer_keeps_its_native_grpc_probes() -> None:
    container = main_container(rendered("default"), "trainer")
    assert "command" not in container and container["livenessProbe"]["grpc"]["port"] == 50054


# -- the model volume -----------------------------------------------------------------------------------------------


def test_a_read_write_once_model_volume_is_refused_unless_everything_runs_on_one_node() -> None:
    rwo = {"models": {**MODEL_PVC, "accessModes": ["ReadWriteOnce"]}}
    assert "Multi-Attach" in render_error(rwo)
    assert render({"models": {**MODEL_PVC, "accessModes": ["ReadWriteOnce"], "singleNode": True}})
    assert render({"models": {**MODEL_PVC, "accessModes": ["ReadOnlyMany"]}})


def test_a_fill_job_writes_the_model_and_inference_and_trainer_wait_for_its_marker() -> None:
    fill = {"enabled": True, "image": "registry.example.com/models/qwen:1", "path": "/model"}
    docs = render({"models": {**MODEL_PVC, "accessModes": ["ReadWriteMany"], "fill": fill}, **MULTI})
    job = workload(docs, "model-fill")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == fill["image"]
    marker = "/models/tiny/.relayrl-model-ready"
    assert container["command"][-3:] == ["/models/tiny", marker, "/model"]
    (volume,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": False}
    for svc in ("inference", "trainer"):
        (init,) = workload(docs, svc)["spec"]["template"]["spec"]["initContainers"]
        assert init["name"] == "wait-model" and marker in init["command"], svc


def test_a_fill_from_a_url_needs_its_checksum_and_a_writable_volume_and_gets_its_own_egress() -> None:
    url = {"enabled": True, "url": "https://models.example.com/qwen.tar.gz"}
    rwx = {**MODEL_PVC, "accessModes": ["ReadWriteMany"]}
    assert "needs models.fill.sha256" in render_error({"models": {**rwx, "fill": url}})
    assert "needs ReadWriteOnce or ReadWriteMany" in render_error(
        {"models": {**MODEL_PVC, "fill": {**url, "sha256": "0" * 64}}}
    )
    egress = [{"to": [{"ipBlock": {"cidr": "203.0.113.0/24"}}], "ports": [{"port": 443, "protocol": "TCP"}]}]
    docs = render({"models": {**rwx, "fill": {**url, "sha256": "a" * 64, "egress": egress}}})
    policies = {p["metadata"]["name"].removeprefix("rl-relayrl-"): p for p in objects(docs, "NetworkPolicy")}
    assert policies["model-fill"]["spec"]["egress"] == egress
    assert all(
        rule not in p["spec"].get("egress", [])
        for name, p in policies.items()
        if name != "model-fill"
        for rule in egress
    )
    assert "a" * 64 in workload(docs, "model-fill")["spec"]["template"]["spec"]["containers"][0]["command"]


def test_a_trainer_that_would_start_its_run_over_after_a_restart_is_refused() -> None:
    never = {"config": {"trainer": {"checkpoint": {"resume": "never"}}}}
    assert "config.trainer.checkpoint.resume must be auto" in render_error(never)


@pytest.mark.parametrize(
    "source",
    [{"image": "registry.example.com/models/m:1"}, {"url": "https://models.example.com/m.tar.gz", "sha256": "b" * 64}],
)
def test_objects_that_only_optional_values_render_validate_against_kubernetes_schemas(source: dict[str, str]) -> None:
    docs = render(
        {
            "models": {**MODEL_PVC, "accessModes": ["ReadWriteMany"], "fill": {"enabled": True, **source}},
            "rollout": {"persistence": {"enabled": True}},
            "trainer": {"nodes": 2, "pdb": {"enabled": True}, "hostNetwork": True},
            "redis": {"exporter": {"enabled": True}},
            "monitoring": {
                "namespaceSelector": {"matchLabels": {"team": "mon"}},
                "grafanaDashboard": {"enabled": True},
            },
        }
    )
    assert objects(docs, "Job") and objects(docs, "PodDisruptionBudget")
    for version in KUBE_VERSIONS:
        for doc in (d for d in docs if d["kind"] not in CRD_KINDS):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"Kubernetes {version}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}")


def test_changed_fill_values_get_a_new_job_since_a_jobs_template_cannot_change() -> None:
    def job_name(path: str) -> str:
        fill = {"enabled": True, "image": "registry.example.com/models/m:1", "path": path}
        docs = render({"models": {**MODEL_PVC, "accessModes": ["ReadWriteMany"], "fill": fill}})
        return str(workload(docs, "model-fill")["metadata"]["name"])

    assert job_name("/model") == job_name("/model") != job_name("/other")
    assert job_name("/model").startswith("rl-relayrl-model-fill-")
