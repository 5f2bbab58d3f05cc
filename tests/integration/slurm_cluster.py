"""A real one-node Slurm cluster for a test: munged, slurmctld and slurmd (Debian's slurm-wlm, installed by `make
test`) with their own configuration, state, sockets and ports under a temporary folder, as root."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")


def _conf(root: Path, host: str) -> str:
    settings = {
        "ClusterName": "relayrl-test",
        "SlurmctldHost": host,
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        "AuthInfo": f"socket={root}/munge/munge.sock",
        "ProctrackType": "proctrack/linuxproc",  # no cgroups in a container: processes tracked by parentage
        "TaskPlugin": "task/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_Core",
        "ReturnToService": "2",
        "StateSaveLocation": f"{root}/state",
        "SlurmdSpoolDir": f"{root}/spool",
        "SlurmctldPidFile": f"{root}/slurmctld.pid",
        "SlurmdPidFile": f"{root}/slurmd.pid",
        "SlurmctldPort": str(free_port()),
        "SlurmdPort": str(free_port()),
        "SlurmctldLogFile": f"{root}/slurmctld.log",
        "SlurmdLogFile": f"{root}/slurmd.log",
        "KillWait": "60",  # scancel: SIGTERM, then SIGKILL after this; the trainer's graceful stop fits in it
    }
    lines = [f"{k}={v}" for k, v in settings.items()]
    lines.append(f"NodeName={host} CPUs={os.cpu_count()} RealMemory=4000 State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[dict[str, str]]:
    """The cluster's client environment (SLURM_CONF) while the block runs; every daemon stopped after."""
    missing = [d for d in (*DAEMONS, "sbatch", "scancel", "squeue") if shutil.which(d) is None]
    if missing:
        pytest.fail(f"{missing} not installed: scripts/ensure_system_deps.sh installs slurmctld, slurmd and munge")
    if os.geteuid() != 0:
        pytest.skip("a Slurm cluster of its own needs root (slurmd starts jobs as their users)")
    host = socket.gethostname().split(".")[0]
    for folder in ("state", "spool", "munge"):
        (root / folder).mkdir(parents=True, mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, host))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munge = [f"--socket={root}/munge/munge.sock", f"--key-file={key}", f"--pid-file={root}/munge/munged.pid"]
    munge += [f"--log-file={root}/munge/munged.log", f"--seed-file={root}/munge/seed", "--force"]
    subprocess.run(["munged", *munge], check=True, timeout=30)
    subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=env, timeout=30)
    subprocess.run(["slurmd", "-f", str(conf)], check=True, env=env, timeout=30)
    try:
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, (root / "slurmctld.log").read_text()[-3000:]
            time.sleep(0.5)
        yield {"SLURM_CONF": str(conf)}
    finally:
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((root / pid_file).read_text()), 15)
        time.sleep(1)
