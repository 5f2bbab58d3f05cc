"""Hold under attack, finding 5: the launcher's stop deadline. `relayrl run` used to SIGKILL any service that had
not exited 15 s after SIGTERM, so a trainer whose step takes longer could never write its final checkpoint. Now
the trainer's deadline follows its measured steps (metrics.jsonl) and trainer.stop_grace_s, and the trainer stops
before the servers its final checkpoint may need (inference for a push still in flight).

The children here are stand-ins (real processes): what is tested is the launcher's shutdown, not a trainer."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relayrl.common.metrics_row import RlRow
from relayrl.config import load_run_config
from relayrl.launcher import Child, Launcher
from tests.conftest import REPO

pytestmark = pytest.mark.integration

# a stand-in service: on SIGTERM it notes whether <peer marker> exists, waits EXIT_AFTER_S (a long last
# micro-batch and checkpoint), writes its own marker and exits 0
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    name, delay, peer, folder = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
    def stop(*_):
        with open(os.path.join(folder, name + ".sigterm"), "w") as f:
            f.write("peer stopped first" if os.path.exists(os.path.join(folder, peer + ".exited")) else "peer running")
        time.sleep(delay)
        open(os.path.join(folder, name + ".exited"), "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    open(os.path.join(folder, name + ".ready"), "w").close()
    while True:
        time.sleep(1)
""")


def _launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> Launcher:
    monkeypatch.delenv("RELAYRL_REDIS_URL", raising=False)  # no summary from a Redis: only the stop is tested
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_run_config(
        None, [f"model.path={model}", f"rollout.dataset={REPO / 'examples/data/arithmetic.jsonl'}", *overrides]
    )
    launcher = Launcher(cfg, tmp_path / "run", progress=io.StringIO())
    (tmp_path / "run" / "logs").mkdir(parents=True)
    return launcher


def _start(launcher: Launcher, name: str, delay_s: float, peer: str) -> Child:
    folder = launcher.out
    log = (folder / "logs" / f"{name}.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, name, str(delay_s), peer, str(folder)], stdout=log, stderr=subprocess.STDOUT
    )
    child = launcher.children[name] = Child(name, proc, log, folder / "config.yaml")
    while not (folder / f"{name}.ready").exists():  # its SIGTERM handler is installed
        assert proc.poll() is None
    return child


@pytest.mark.slow
def test_a_trainer_that_needs_longer_than_15s_to_stop_is_waited_for_as_its_measured_steps_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = _launcher(tmp_path, monkeypatch, "trainer.stop_grace_s=5")
    # 20 s steps measured: the trainer may be 20 s from its next micro-batch boundary, then checkpoints
    launcher.cfg.metrics_path.write_text(
        "".join(
            json.dumps(RlRow(step=s, step_time_s=20.0, weight_sync_s=0.5, time_checkpoint_s=2.0).to_json()) + "\n"
            for s in (1, 2)
        )
    )
    trainer = _start(launcher, "trainer", 16.5, "none")  # past the old constant 15 s, within 1.5 x 22.5 s

    launcher.shutdown()

    assert trainer.proc.returncode == 0  # not SIGKILLed (-9)
    assert (launcher.out / "trainer.exited").exists()
    said = launcher.progress.getvalue()  # type: ignore[attr-defined]
    assert "waiting up to 34s for the trainer to stop gracefully" in said
    assert "longest step 20.0s + push 0.5s + checkpoint 2.0s" in said and "the measured steps" in said


def test_the_trainer_stops_before_inference_which_its_final_checkpoint_may_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = _launcher(tmp_path, monkeypatch)
    inference = _start(launcher, "inference", 0.0, "trainer")
    trainer = _start(launcher, "trainer", 0.5, "inference")

    launcher.shutdown()

    assert (trainer.proc.returncode, inference.proc.returncode) == (0, 0)
    assert (launcher.out / "trainer.sigterm").read_text() == "peer running"  # inference served meanwhile
    assert (launcher.out / "inference.sigterm").read_text() == "peer stopped first"
