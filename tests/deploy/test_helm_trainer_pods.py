"""The chart's multi-node trainer, run for real as two "pods" on this machine.

No cluster here, so the pods are process trees that see the cluster's DNS names through a private /etc/hosts
(a mount namespace per process, `unshare --mount`): the Services' names and the trainer pods' stable names under
the headless Service resolve to loopback addresses, pod 1 on another one than pod 0. Everything else is what the
chart renders: the ConfigMap's run config (service addresses, Redis URL, world size), the trainer container's
torchrun script (c10d rendezvous hosted by pod 0, `--local-addr`, `is_host`), and `relayrl serve` for the other
services. Checks that the two agents form one world, that pod 0 holds rank 0 even when pod 1 starts first, and that
training runs to the end with checkpoints.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.conftest import REPO, RedisServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.integration]

CHART = REPO / "charts" / "relayrl"
RELEASE = "rl"
STEPS = 6


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    files = helm.Chart.load(CHART).render(values, name=RELEASE, namespace="ml", is_install=True)
    return [d for path, text in sorted(files.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def _in_pod(hosts: Path, command: list[str], volume: tuple[Path, Path] | None = None) -> list[str]:
    """``command`` in its own mount namespace where /etc/hosts is ``hosts`` (cluster DNS for one process tree)
    and, with ``volume`` = (pod's own directory, mount path), the pod's own volume is mounted at the mount path."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("unshare (util-linux) is required to give the simulated pods their DNS names")
    user_ns = [] if os.geteuid() == 0 else ["--map-root-user"]
    source, target = volume or (hosts.parent, hosts.parent)
    return [unshare, *user_ns, "--mount", "--", "sh", "-c",
            'mount --bind "$1" /etc/hosts && mount --bind "$2" "$3" && shift 3 && exec "$@"',
            "sh", str(hosts), str(source), str(target), *command]


class Pods:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, command: list[str], env: dict[str, str]) -> None:
        with (self.logs / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Pods]:
    (tmp_path / "logs").mkdir()
    running = Pods(tmp_path / "logs")
    yield running
    running.stop()


def test_two_trainer_pods_rendezvous_at_pod_zero_and_train_to_the_end(
        tmp_path: Path, redis_server: RedisServer, demo_model: Path, pods: Pods) -> None:
    runs = tmp_path / "runs"
    values = {
        "redis": {"external": {"url": redis_server.url}},
        **{svc: {"port": free_port()} for svc in ("reward", "rollout")},
        "inference": {"port": free_port(), "weightsPort": free_port()},
        "trainer": {"port": free_port(), "nodes": 2, "nprocPerNode": 1, "rendezvous": {"port": free_port()},
                    "persistence": {"mountPath": str(runs)}},
        "config": {"model": {"path": str(demo_model)},
                   "rollout": {"dataset": str(REPO / "examples" / "data" / "arithmetic.jsonl")},
                   "trainer": {"total_steps": STEPS, "checkpoint_every": 3, "groups_per_step": 4,
                               "collective_timeout_s": 60}},
    }
    docs = _render(values)
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    config = tmp_path / "relayrl.yaml"
    config.write_text(configmap["data"]["relayrl.yaml"])
    trainer = next(d for d in docs if d["kind"] == "StatefulSet" and d["spec"]["serviceName"].endswith("-headless"))
    name, headless = trainer["metadata"]["name"], trainer["spec"]["serviceName"]
    script = trainer["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "/config/relayrl.yaml" in script
    script = script.replace("/config/relayrl.yaml", str(config))

    services = [f"{RELEASE}-relayrl-{svc}" for svc in ("inference", "reward", "rollout", "trainer")]
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost {' '.join(services)}\n"
                     f"127.0.0.1 {name}-0.{headless}\n"
                     f"127.0.0.2 {name}-1.{headless}\n")
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-credentials"))
    tokens = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1",  # the credentials the chart's Secret gives its pods (secretKeyRef)
           "RELAYRL_CONTROL_TOKEN": tokens["control-token"], "RELAYRL_WEIGHTS_TOKEN": tokens["weights-token"]}
    for svc in ("inference", "reward"):
        pods.start(svc, _in_pod(hosts, [sys.executable, "-m", "relayrl.cli", "serve", svc, str(config)]), env)
    runs.mkdir()
    volumes = {index: tmp_path / f"trainer-{index}-volume" for index in (0, 1)}  # one PVC per pod, not shared
    for index in (1, 0):  # pod 1 first: rank 0 must still land on pod 0
        volumes[index].mkdir()
        pods.start(f"trainer-{index}", _in_pod(hosts, ["sh", "-c", script], (volumes[index], runs)),
                   {**env, "POD_NAME": f"{name}-{index}"})
    pods.start("rollout", _in_pod(hosts, [sys.executable, "-m", "relayrl.cli", "serve", "rollout", str(config)]), env)

    deadline = time.monotonic() + 300
    agents = [pods.procs["trainer-0"], pods.procs["trainer-1"]]
    while time.monotonic() < deadline and any(p.poll() is None for p in agents):
        for svc in ("inference", "reward", "rollout"):
            assert pods.procs[svc].poll() is None, f"{svc} died:\n{pods.log(svc)[-3000:]}"
        time.sleep(0.5)
    codes = [p.poll() for p in agents]
    tails = "\n".join(pods.log(f"trainer-{i}")[-3000:] for i in (0, 1))
    assert codes == [0, 0], f"trainer exit codes {codes}\n{tails}"

    assert "[trainer rank=0]" in pods.log("trainer-0") and "[trainer rank=1]" not in pods.log("trainer-0")
    assert "[trainer rank=1]" in pods.log("trainer-1") and "[trainer rank=0]" not in pods.log("trainer-1")
    rows = [json.loads(line) for line in (volumes[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert {r["world_size"] for r in rows} == {2}
    checkpoints = volumes[0] / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000003", "step_000006"]
    assert {p.name for p in (checkpoints / "step_000006").glob("rank*.pt")} == {"rank0.pt", "rank1.pt"}
    assert not (volumes[1] / "checkpoints").exists()  # pod 1 never needs pod 0's volume
