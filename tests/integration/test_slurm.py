"""`relayrl slurm` on a real one-node Slurm cluster (tests/integration/slurm_cluster.py): the quickstart submitted
with sbatch trains; scancel mid-run stops every process of it; submitting again resumes from its checkpoint, trains
the remaining steps once each, and the books add up at the end. The credentials are files readable by their owner
only, never on a command line. That the quickstart learns is tests/e2e/test_quickstart.py's to show: here the steps
are as few as the checkpoint and the cancel need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO
from tests.integration.slurm_cluster import slurm_cluster
from tests.polling import wait_for

pytestmark = [pytest.mark.slow(seconds=45), pytest.mark.integration]

STEPS = 24
CHECKPOINT_EVERY = 5
CANCEL_AFTER = 8  # steps: past the checkpoint at 5


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, str]]:
    with slurm_cluster(tmp_path / "slurm") as env:
        yield {**os.environ, **env}


def _steps(run: Path) -> list[dict[str, object]]:
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r.get("phase", "rl") == "rl"]


def _jobs(env: dict[str, str]) -> list[str]:
    return subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()


def _processes_of(run: Path) -> list[str]:
    """Every process whose command line names the run folder (the services, torchrun, redis's step)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "pid"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(run) in cmdline and proc.info["pid"] != os.getpid():
            found.append(cmdline)
    return found


def test_the_quickstart_as_a_slurm_job_trains_stops_on_scancel_and_resumes_when_submitted_again(
    tmp_path: Path, demo_model: Path, cluster: dict[str, str]
) -> None:
    run = tmp_path / "run"
    overrides = [
        f"model.path={demo_model}",
        f"trainer.total_steps={STEPS}",
        f"trainer.checkpoint.every={CHECKPOINT_EVERY}",
    ]
    # scancel stops Redis and inference with the trainer, whose graceful stop then often waits its whole grace in vain
    # and ends without a final checkpoint, and a checkpoint in progress retries its acknowledgement for redis.retry_s
    # (docs/deploy.md): a short grace and retry, so the cancel is over in seconds, not 30 + 60 s
    overrides += ["trainer.stop_grace_s=5", "redis.retry_s=5"]
    submit = [sys.executable, "-m", "relayrl.cli", "slurm", "submit", "examples/quickstart.yaml", "--out", str(run)]
    first = subprocess.run(
        [*submit, *(a for o in overrides for a in ("--set", o))],
        cwd=REPO,
        env=cluster,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr
    job = first.stdout.split()[-1]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in (run / "credentials").iterdir()} == {
        name: "0o600" for name in ("control_token", "weights_token", "code_token", "redis_password")
    }
    wait_for(lambda: len(_steps(run)) >= CANCEL_AFTER, f"{CANCEL_AFTER} steps of job {job}", timeout_s=300)
    secrets = [(run / "credentials" / n).read_text().strip() for n in ("control_token", "redis_password")]
    assert not [c for c in _processes_of(run) if any(s in c for s in secrets)]  # never on a command line

    subprocess.run(["scancel", job], env=cluster, check=True, timeout=30)

    wait_for(lambda: not _jobs(cluster) and not _processes_of(run), "every process of the job gone", timeout_s=120)
    cancelled_at = len(_steps(run))
    # the newest complete checkpoint (one being written when the job was cancelled is still step_*.tmp): a periodic
    # one, or the final one of the stop when the trainer wrote it before Redis was gone
    resumable = max(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*") if p.name[5:].isdigit())
    assert CHECKPOINT_EVERY <= resumable <= cancelled_at < STEPS

    again = subprocess.run(
        ["sbatch", "--parsable", str(run / "relayrl.sbatch")], env=cluster, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0, again.stderr
    wait_for(lambda: not _jobs(cluster), "the resubmitted job to finish", timeout_s=600)

    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert f"resumed from {run / 'checkpoints' / f'step_{resumable:06d}'} at step {resumable}" in trainer_log, (
        trainer_log[-3000:]
    )
    steps = [int(str(r["step"])) for r in _steps(run)]
    # the first job's rows up to the cancel, then the resumed job's from the step after its checkpoint to the end
    assert steps[cancelled_at:] == list(range(resumable + 1, STEPS + 1)), steps
    summary = json.loads((run / "summary.json").read_text())
    drops = sum(v for k, v in summary.items() if k.startswith("groups_dropped_"))
    assert summary["groups_produced"] == (
        summary["groups_trained"] + drops + summary["groups_invalid"] + summary["groups_pending"]
    )
    assert summary["groups_trained"] == STEPS * 8
    assert not _processes_of(run)
