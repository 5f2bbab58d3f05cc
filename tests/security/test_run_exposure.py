"""What a `relayrl run` exposes on its host, checked on one real run (redis-server, the four services):
each service's environment holds only its own credentials (relayrl.common.credentials.HELD), also when the caller
exported all of them; every REST server refuses a request naming another host (DNS rebinding); and nothing of
the run folder (Redis AOF, checkpoints, logs, metrics, TensorBoard events) is open to the group or others."""

from __future__ import annotations

import os
import secrets
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from relayrl.common.credentials import HELD, variables
from relayrl.config import load_run_config
from relayrl.config.control import ControlConfig
from relayrl.config.redis import RedisConfig
from tests.conftest import REPO
from tests.polling import wait_for

pytestmark = [pytest.mark.security, pytest.mark.integration, pytest.mark.slow]

SERVICES = ("inference", "reward", "rollout", "trainer")
CALLER_CREDENTIALS = {
    name: secrets.token_urlsafe(32)
    for name in ("RELAYRL_CONTROL_TOKEN", "RELAYRL_WEIGHTS_TOKEN", "RELAYRL_CODE_TOKEN", "RELAYRL_REDIS_PASSWORD")
}


@dataclass
class Run:
    out: Path
    environments: dict[str, dict[str, str]]  # service -> its process's environment (/proc/<pid>/environ)
    hosts: dict[str, dict[str, int]]  # service -> Host header -> status of GET /healthz with it
    output: str


def _environ(proc: psutil.Process) -> dict[str, str]:
    raw = Path(f"/proc/{proc.pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)


def _services(launcher: subprocess.Popen[str]) -> dict[str, psutil.Process]:
    found: dict[str, psutil.Process] = {}
    for child in psutil.Process(launcher.pid).children():
        cmdline = child.cmdline()
        for name in SERVICES:
            if cmdline[-3:-1] == ["serve", name]:
                found[name] = child
    return found


def _get(port: int, host: str) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/healthz", headers={"Host": host})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Run]:
    out = tmp_path_factory.mktemp("exposure") / "run"
    env = {**os.environ, **CALLER_CREDENTIALS}
    env.pop("RELAYRL_REDIS_URL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "run",
            "examples/quickstart.yaml",
            "--out",
            str(out),
            "--set",
            f"model.path={demo_model}",
            "--set",
            "trainer.total_steps=100000",
            "--set",
            "trainer.checkpoint.every=2",
            "--set",
            "rollout.max_new_tokens=2",
            "--set",
            "tracking.tensorboard=true",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics = out / "metrics.jsonl"
        wait_for(
            lambda: (
                metrics.exists()
                and len(metrics.read_text().splitlines()) >= 3
                and any((out / "checkpoints").glob("step_*"))
            ),
            "training and a checkpoint",
            alive=proc,
        )
        environments = {name: _environ(p) for name, p in _services(proc).items()}
        cfg = load_run_config(out / "config.yaml")
        hosts = {}
        for name in SERVICES:
            port = getattr(cfg, name).http.port
            hosts[name] = {
                h: _get(port, h)
                for h in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port}", f"localhost:{port}")
            }
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    yield Run(out, environments, hosts, output)


def test_each_service_holds_only_its_own_credentials_even_when_the_caller_exported_all(run: Run) -> None:
    assert set(run.environments) == set(SERVICES), run.output[-3000:]
    carried = variables(ControlConfig(), RedisConfig())
    every = {name for names in carried.values() for name in names}
    for service, environment in run.environments.items():
        expected = {name for credential in HELD[service] for name in carried[credential]} & {
            *CALLER_CREDENTIALS
        }  # the embedded Redis: no URL variable, its URL is in config.yaml
        assert {name for name in environment if name in every} == expected, service
        for name in expected:  # the caller's credentials are the run's
            assert environment[name] == CALLER_CREDENTIALS[name], (service, name)


def test_every_rest_server_of_a_run_refuses_another_hosts_name_and_answers_loopback(run: Run) -> None:
    for service, statuses in run.hosts.items():
        assert [statuses[h] for h in statuses if h.startswith("evil")] == [400, 400], service
        assert [statuses[h] for h in statuses if not h.startswith("evil")] == [200, 200], service


def test_nothing_in_the_run_folder_is_open_to_group_or_others(run: Run) -> None:
    assert "relayrl: SIGTERM" in run.output, run.output[-3000:]
    seen: dict[str, int] = {}
    for root, dirs, files in os.walk(run.out):
        for name in [*dirs, *files]:
            path = Path(root) / name
            if not path.is_symlink():
                seen[str(path.relative_to(run.out))] = stat.S_IMODE(path.lstat().st_mode)
    kinds = {Path(p).parts[0] for p in seen}
    assert {"redis", "checkpoints", "logs", "tensorboard", "metrics.jsonl", "config.yaml", "summary.json"} <= kinds
    assert any(p.startswith("redis") and "appendonly" in p for p in seen), sorted(seen)  # the AOF (every episode)
    assert stat.S_IMODE(run.out.stat().st_mode) == 0o700
    assert {p: oct(m) for p, m in seen.items() if m & 0o077} == {}
