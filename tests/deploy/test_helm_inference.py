"""The chart's inference replicas, rendered offline: a StatefulSet of stably named pods listed as the run's
endpoints, a headless Service that resolves them while not ready, the weights NetworkPolicy and a disruption budget
over every replica, and the GPUs of a tensor-parallel replica."""

from __future__ import annotations

from pathlib import Path

from tests.deploy.chart import (
    _chart,
    component,
    load_config,
    main_container,
    objects,
    reaching,
    render,
    render_error,
    selects,
    service,
    workload,
)

# -- inference replicas --------------------------------------------------------------------------------------------


def test_inference_replicas_are_statefulset_pods_listed_by_stable_name_as_the_runs_endpoints(tmp_path: Path) -> None:
    """inference.replicas=3: three pods with stable names behind a headless Service that resolves them while not
    ready (the trainer must reach a restarted replica to catch it up); the run config lists each pod's gRPC and
    weights address; the weights port admits trainer pods on every replica; a PDB keeps two serving in a drain."""
    docs = render({"inference": {"replicas": 3}})
    sts = workload(docs, "inference")
    assert sts["kind"] == "StatefulSet" and sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    headless = service(docs, sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selects(headless["spec"]["selector"], labels)
    values = _chart().values["inference"]
    assert {p["port"] for p in headless["spec"]["ports"]} == {values["port"], values["weightsPort"]}

    cfg = load_config(docs, tmp_path)
    pods = [f"rl-relayrl-inference-{i}.{headless['metadata']['name']}" for i in range(3)]
    assert [(e.address, e.weights_address) for e in cfg.inference.replica_endpoints()] == [
        (f"{pod}:{values['port']}", f"{pod}:{values['weightsPort']}") for pod in pods
    ]
    (policy,) = [d for d in objects(docs, "NetworkPolicy") if d["metadata"]["name"].endswith("-inference")]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], labels)
    assert reaching(policy, values["weightsPort"]) == {"trainer"}
    (pdb,) = [d for d in objects(docs, "PodDisruptionBudget") if component(d) == "inference"]
    assert pdb["spec"]["maxUnavailable"] == 1 and selects(pdb["spec"]["selector"]["matchLabels"], labels)


def test_one_inference_replica_keeps_the_service_address_and_has_no_disruption_budget(tmp_path: Path) -> None:
    docs = render({})
    assert workload(docs, "inference")["spec"]["replicas"] == 1
    cfg = load_config(docs, tmp_path)
    assert cfg.inference.endpoints == [] and cfg.inference.server.target.startswith("rl-relayrl-inference:")
    assert not [d for d in objects(docs, "PodDisruptionBudget") if component(d) == "inference"]
    assert "at '/inference/replicas': maximum: got 65, want 64" in render_error({"inference": {"replicas": 65}})


def test_tensor_parallel_replicas_each_request_that_many_gpus_and_shared_memory(tmp_path: Path) -> None:
    """vLLM tensor parallelism spreads one replica over tensor_parallel_size GPUs: each replica's pod requests them
    and gets a /dev/shm for NCCL between them; the run config the pods read carries the size."""
    cuda = {"model": {"device": "cuda"}, "inference": {"engine": "vllm", "vllm": {"tensor_parallel_size": 2}}}
    docs = render({"config": cuda, "inference": {"gpu": True, "replicas": 2}, "trainer": {"gpu": True}})
    sts = workload(docs, "inference")
    resources = main_container(docs, "inference")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 2 and resources["requests"]["nvidia.com/gpu"] == 2
    mounts = {m["name"]: m["mountPath"] for m in main_container(docs, "inference")["volumeMounts"]}
    (shm,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm"]
    assert mounts["shm"] == "/dev/shm" and shm["emptyDir"]["medium"] == "Memory"
    assert load_config(docs, tmp_path).inference.vllm.tensor_parallel_size == 2
    plain = render({"config": {"model": {"device": "cuda"}}, "inference": {"gpu": True}, "trainer": {"gpu": True}})
    assert main_container(plain, "inference")["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "shm" not in {v["name"] for v in workload(plain, "inference")["spec"]["template"]["spec"]["volumes"]}
