"""Simulated pods: the chart's rendered objects run as process trees on this machine.

No cluster here, so a "pod" is a process tree that sees the cluster's DNS names through a private /etc/hosts (a
mount namespace per process, `unshare --mount`): the Services' names and the trainer pods' stable names under the
headless Service resolve to loopback addresses, pod 1 on another one than pod 0. Everything else is what the chart
renders: the ConfigMap's run config, the trainer container's torchrun script (c10d rendezvous hosted by pod 0,
`--local-addr`, `is_host`, read and shutdown timeouts), its environment (the config digest) and `relayrl serve` for
the other services. A trainer pod may run under a restart loop, as the kubelet restarts a container that exits.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import psutil
import pytest
import yaml

from tests.conftest import REPO, free_port

CHART = REPO / "charts" / "relayrl"
RELEASE = "rl"
RUN_ID = "sim-run"


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    files = helm.Chart.load(CHART).render(values, name=RELEASE, namespace="ml", is_install=True)
    return [d for path, text in sorted(files.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def values(redis_url: str, model: Path, runs: Path, steps: int, **trainer: Any) -> dict[str, Any]:
    """Two trainer pods of one rank each, every port free on this machine, the run config small."""
    return {
        "run": {"id": RUN_ID},
        "credentials": {"generateOffline": True},  # rendered without a cluster
        "redis": {"external": {"url": redis_url}},
        **{svc: {"port": free_port(), "httpPort": free_port()} for svc in ("reward", "rollout")},
        "inference": {"port": free_port(), "weightsPort": free_port(), "httpPort": free_port()},
        "trainer": {
            "port": free_port(),
            "httpPort": free_port(),
            "nodes": 2,
            "nprocPerNode": 1,
            "rendezvous": {"port": free_port()},
            "persistence": {"mountPath": str(runs)},
            **trainer,
        },
        "config": {
            "model": {"path": str(model)},
            "rollout": {"dataset": str(REPO / "examples" / "data" / "arithmetic.jsonl")},
            "trainer": {"total_steps": steps, "checkpoint_every": 3, "groups_per_step": 4, "collective_timeout_s": 60},
        },
    }


def _in_pod(hosts: Path, command: list[str], volume: tuple[Path, Path] | None = None) -> list[str]:
    """``command`` in its own mount namespace where /etc/hosts is ``hosts`` and, with ``volume`` = (the pod's own
    directory, mount path), the pod's own volume is mounted at the mount path."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("unshare (util-linux) is required to give the simulated pods their DNS names")
    user_ns = [] if os.geteuid() == 0 else ["--map-root-user"]
    source, target = volume or (hosts.parent, hosts.parent)
    return [
        unshare,
        *user_ns,
        "--mount",
        "--",
        "sh",
        "-c",
        'mount --bind "$1" /etc/hosts && mount --bind "$2" "$3" && shift 3 && exec "$@"',
        "sh",
        str(hosts),
        str(source),
        str(target),
        *command,
    ]


# restartPolicy Always: the container's command again whenever it exits (a bounded number of times)
RESTART_LOOP = (
    'n=0; while :; do sh -c "$1"; echo "container exited with $?" >&2; n=$((n+1)); [ "$n" -lt 6 ] || exit 1; done'
)


class Release:
    """One rendered release on this machine: its config file, DNS names, credentials and the pods' processes."""

    def __init__(self, tmp: Path, docs: list[dict[str, Any]], separate_volumes: bool = False) -> None:
        """``separate_volumes``: each pod gets a folder of its own even where the chart mounts one claim on every
        pod (a claim that is not really shared)."""
        self.tmp, self.logs = tmp, tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
        self.config = tmp / "relayrl.yaml"
        self.config.write_text(configmap["data"]["relayrl.yaml"])
        self.trainer = next(
            d for d in docs if d["kind"] == "StatefulSet" and d["spec"]["serviceName"].endswith("-trainer-headless")
        )
        self.name, headless = self.trainer["metadata"]["name"], self.trainer["spec"]["serviceName"]
        self.hosts = tmp / "hosts"
        # every Service name (reward's headless one too) resolves to loopback, the trainer pods' own names apart
        services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service" and d["metadata"]["name"] != headless]
        self.hosts.write_text(
            f"127.0.0.1 localhost {' '.join(services)}\n"
            f"127.0.0.1 {self.name}-0.{headless}\n127.0.0.2 {self.name}-1.{headless}\n"
        )
        secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-credentials"))
        tokens = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
        self.env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONUNBUFFERED": "1",  # the credentials the chart's Secret gives its pods (secretKeyRef)
            "RELAYRL_CONTROL_TOKEN": tokens["control-token"],
            "RELAYRL_WEIGHTS_TOKEN": tokens["weights-token"],
            "RELAYRL_CODE_TOKEN": tokens["code-token"],
        }
        self.runs = Path(yaml.safe_load(self.config.read_text())["output_dir"]).parent
        # one PVC per pod (volumeClaimTemplates), or one claim every pod mounts (persistence.shared, existingClaim)
        shared = "volumeClaimTemplates" not in self.trainer["spec"] and not separate_volumes
        self.volumes = {i: tmp / ("trainer-shared-volume" if shared else f"trainer-{i}-volume") for i in (0, 1)}
        self.rollout_volume = tmp / "rollout-volume"

    def trainer_script(self) -> str:
        script = str(self.trainer["spec"]["template"]["spec"]["containers"][0]["args"][0])
        assert "/config/relayrl.yaml" in script
        return script.replace("/config/relayrl.yaml", str(self.config))

    def trainer_env(self) -> dict[str, str]:
        """The trainer container's literal environment (the config digest among it)."""
        container = self.trainer["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e["value"] for e in container["env"] if "value" in e}

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        with (self.logs / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                command, env=env or self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start_services(self, *services: str) -> None:
        for svc in services:
            volume = None
            if svc == "rollout":
                self.rollout_volume.mkdir(exist_ok=True)
                volume = (self.rollout_volume, self.runs)
            self.start(
                svc, _in_pod(self.hosts, [sys.executable, "-m", "relayrl.cli", "serve", svc, str(self.config)], volume)
            )

    def start_trainer_pod(
        self, index: int, *, restart: bool = False, script: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.volumes[index].mkdir(exist_ok=True)
        script = script or self.trainer_script()
        command = ["sh", "-c", RESTART_LOOP, "loop", script] if restart else ["sh", "-c", script]
        self.start(
            f"trainer-{index}",
            _in_pod(self.hosts, command, (self.volumes[index], self.runs)),
            {**self.env, **(env or self.trainer_env()), "POD_NAME": f"{self.name}-{index}"},
        )

    def kill(self, name: str) -> None:
        """The pod is gone at once (deleted, its node lost): SIGKILL to its whole process tree. torchrun starts
        its workers in sessions of their own, so the process group alone would leave them running (a container's
        end kills every process in it)."""
        tree = _descendants(self.procs[name].pid)
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        _kill_all(tree)
        self.procs[name].wait()

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def output(self, index: int) -> Path:
        """Trainer pod ``index``'s output directory of this run, on its own volume."""
        return self.volumes[index] / RUN_ID

    def wait(self, done: Callable[[], bool], timeout_s: float, what: str, services: tuple[str, ...] = ()) -> None:
        """Poll ``done`` until true; fail naming ``what`` (with the trainer logs) after ``timeout_s``, or at once when
        one of ``services`` died."""
        deadline = time.monotonic() + timeout_s
        while not done():
            for svc in services:
                assert self.procs[svc].poll() is None, f"{svc} died:\n{self.log(svc)[-3000:]}"
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}\n{self.log(n)[-4000:]}" for n in self.procs if n.startswith("trainer"))
                pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")
            time.sleep(0.5)

    def stop(self, name: str, timeout_s: float = 60) -> int:
        """SIGTERM to the pod's main process (what the kubelet sends), then its exit status."""
        proc = self.procs[name]
        os.kill(proc.pid, signal.SIGTERM)
        return proc.wait(timeout_s)

    def stop_all(self) -> None:
        tree = [p for proc in self.procs.values() for p in _descendants(proc.pid)]
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        _kill_all(tree)  # nothing of a pod outlives the test (workers in sessions of their own included)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_all(processes: list[psutil.Process]) -> None:
    for p in processes:
        with contextlib.suppress(psutil.Error):  # already gone
            p.kill()
