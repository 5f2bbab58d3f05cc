"""Commands and services that have no use for torch never import it: `relayrl status`, `relayrl control`, and
the rollout and reward services, each run in a subprocess where importing torch raises ImportError."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.common.grpc_utils import check_health
from relayrl.common.metrics_row import RlRow
from relayrl.config import dump_run_config, load_run_config
from tests.conftest import REPO, RedisServer, free_port

pytestmark = pytest.mark.integration

# Runs `relayrl <args>` with an import blocker for torch; any attempt to import it (even one the importer
# catches) is reported on stderr at exit.
BLOCKED = """
import atexit, sys

attempts = []

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            attempts.append(name)
            raise ImportError(f"{name} is blocked: this command must not import torch")
        return None

sys.meta_path.insert(0, NoTorch())
atexit.register(lambda: attempts and print("TORCH IMPORTED: " + ", ".join(attempts), file=sys.stderr))
from relayrl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _relayrl(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", BLOCKED, *args],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert "TORCH IMPORTED" not in err and "is blocked" not in err, err
    return proc.returncode, out, err


def _run_dir(tmp_path: Path, dataset: Path, redis_url: str = "", *overrides: str) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_run_config(
        None,
        [
            f"output_dir={run}",
            f"rollout.dataset={dataset}",
            f"redis.url={redis_url}",
            *(f"{s}.server.port={free_port()}" for s in ("inference", "reward", "rollout", "trainer")),
            *(f"{s}.http.host=127.0.0.1" for s in ("reward", "rollout")),
            *(f"{s}.http.port=0" for s in ("reward", "rollout")),
            "reward.workers=1",
            *overrides,
        ],
    )
    dump_run_config(cfg, run / "config.yaml")
    return run


def test_status_of_a_run_folder_imports_no_torch(tmp_path: Path, dataset_path: Path, redis_server: RedisServer) -> None:
    run = _run_dir(tmp_path, dataset_path, redis_server.url)
    rows = [RlRow(step=s, reward_mean=0.5, staleness_mean=0.25, staleness_max=1, episodes_per_s=10.0) for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in rows))

    code, out, _ = _finish(_relayrl("status", str(run)))

    assert code == 1  # no service runs: each is reported DOWN
    assert "trainer" in out and "DOWN" in out
    assert "queue      " in out  # Redis was asked (no stream yet)
    assert "training   last 2 steps to step 2: reward 0.500" in out


def test_control_imports_no_torch(tmp_path: Path, dataset_path: Path) -> None:
    run = _run_dir(tmp_path, dataset_path)

    help_code, help_out, _ = _finish(_relayrl("control", "--help"))
    code, _, err = _finish(_relayrl("control", "pause", str(run)))

    assert help_code == 0 and "pause" in help_out
    assert code == 1 and "pause failed: UNAVAILABLE" in err  # the target is stopped


@pytest.mark.parametrize("service", ["rollout", "reward"])
def test_starting_the_service_imports_no_torch(
    tmp_path: Path, dataset_path: Path, redis_server: RedisServer, service: str
) -> None:
    run = _run_dir(tmp_path, dataset_path, redis_server.url)
    target = load_run_config(run / "config.yaml").__getattribute__(service).server.target
    proc = _relayrl("serve", service, str(run / "config.yaml"))
    try:
        deadline = time.monotonic() + 60
        while not check_health(target, 1.0):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"{service} did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        code, _, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert code == 0, err[-3000:]
    if service == "rollout":
        assert json.loads((run / "rollout_state.json").read_text())["groups_produced"] == 0
