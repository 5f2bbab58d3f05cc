"""What a relayrl Slurm job runs (relayrl.launcher.slurm): the services as ``srun`` steps on the job's nodes, in
order and each waited for until healthy, then the run until the trainer finishes (or ``scancel``); and Redis's
own step (:func:`serve_redis`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from relayrl.common.grpc_utils import check_health
from relayrl.common.redis_conn import sync_client
from relayrl.config import RunConfig, dump_run_config, load_run_config
from relayrl.launcher.slurm import (
    HEALTHY_WITHIN_S,
    JOB_CONFIG,
    SlurmPlan,
    job_nodes,
    load_job,
    place,
    read_credentials,
    step_env,
    stop_steps,
    summarise,
)
from relayrl.local_redis import find_redis_server, redis_server_args, secret_config, server_environment

Popen = subprocess.Popen[bytes]
Steps = dict[str, Popen]


class Cancelled(Exception):
    """scancel (SIGTERM to the job's steps and to this batch step): the steps stop by themselves."""


def _srun(run_dir: Path, name: str, nodes: list[str], command: list[str], env: dict[str, str]) -> Popen:
    """One step of ``len(nodes)`` tasks, one a node, its output in logs/<name>.log."""
    srun = ["srun", "--overlap", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1"]
    srun += [f"--nodelist={','.join(nodes)}", f"--job-name={name}", f"--output={run_dir}/logs/{name}.log"]
    srun += ["--open-mode=append", "--kill-on-bad-exit=0"]
    return subprocess.Popen([*srun, *command], env=env, stdin=subprocess.DEVNULL)


def _serve(service: str, config: Path) -> list[str]:
    return _relayrl("serve", service, str(config))


def _trainer_command(cfg: RunConfig, plan: SlurmPlan, config: Path, head: str) -> list[str]:
    if plan.trainer_nodes * plan.nproc_per_node == 1:
        return _serve("trainer", config)
    rendezvous = [f"--nnodes={plan.trainer_nodes}", f"--nproc-per-node={plan.nproc_per_node}", "--rdzv-backend=c10d"]
    rendezvous += [f"--rdzv-endpoint={head}:29400", f"--shutdown-timeout={int(cfg.trainer.stop_grace_max_s)}"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, *_serve("trainer", config)[1:]]


def _wait(ready: Callable[[], bool], steps: Steps, what: str, cancelled: list[bool]) -> None:
    deadline = time.monotonic() + HEALTHY_WITHIN_S
    while not ready():
        if cancelled:
            raise Cancelled
        dead = [n for n, p in steps.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {'step ' + ', '.join(dead) + ' ended' if dead else 'not healthy in time'}")
        time.sleep(0.5)


def _redis_up(cfg: RunConfig, password: str) -> bool:
    try:
        return bool(sync_client(cfg.redis, socket_timeout=1.0, password=password).ping())
    except redis.exceptions.RedisError:
        return False


def run_job(run_dir: Path) -> int:
    """The whole run, in the job (its exit status: the trainer's once it finished, 143 after scancel)."""
    cfg, plan = load_job(run_dir)
    nodes = job_nodes()
    cfg, where = place(cfg, nodes)
    config = run_dir / JOB_CONFIG
    dump_run_config(cfg, config)
    creds = read_credentials(run_dir, cfg)
    password = creds[cfg.redis.password_env]
    cancelled: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: cancelled.append(True))
    steps: Steps = {}

    def start(name: str, on: list[str], command: list[str] | None = None) -> None:
        service = name.partition("-")[0]
        env = step_env(service, cfg, creds) if service != "redis" else _slurm_only()  # Redis: its password file
        steps[name] = _srun(run_dir, name, on, command or _serve(service, config), env)

    try:
        port = cfg.redis.url.rpartition(":")[2].partition("/")[0]
        start("redis", nodes[:1], [*_relayrl("slurm", "redis", str(run_dir), "--port", port), *_bind_all(nodes)])
        _wait(lambda: _redis_up(cfg, password), steps, "redis", cancelled)
        start("reward", nodes[:1])
        for name, node in where.items():
            start(name, [node])
        targets = [cfg.reward.server.target, *(e.address for e in cfg.inference.replica_endpoints())]
        _wait(lambda: all(check_health(t, 1.0, tls=cfg.tls) for t in targets), steps, "reward, inference", cancelled)
        start("trainer", nodes[: plan.trainer_nodes], _trainer_command(cfg, plan, config, nodes[0]))
        _wait(lambda: check_health(cfg.trainer.server.target, 1.0, tls=cfg.tls), steps, "trainer", cancelled)
        start("rollout", nodes[:1])
        while steps["trainer"].poll() is None:
            if cancelled:
                raise Cancelled
            time.sleep(1.0)
        stop_steps(steps, ["rollout"], 60.0)
        stop_steps(steps, [n for n in steps if n.startswith(("inference", "reward"))], 30.0)
        summarise(cfg, run_dir, password)
        return steps["trainer"].returncode
    except Cancelled:
        print("relayrl: cancelled; every step stops at its safe point", flush=True)
        for proc in steps.values():  # Slurm signalled each step itself: wait for them, up to its KillWait
            proc.wait()
        return 143
    finally:
        stop_steps(steps, list(steps), 30.0)


def _slurm_only() -> dict[str, str]:
    """The environment of Redis's step: what srun needs to run in this job, and none of the run's credentials."""
    return {k: v for k, v in os.environ.items() if k.startswith("SLURM") or k in ("PATH", "LANG", "LC_ALL", "TZ")}


def _relayrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "relayrl.cli", *args]


def _bind_all(nodes: list[str]) -> list[str]:
    return ["--bind-all"] if len(nodes) > 1 else []


def serve_redis(run_dir: Path, port: int, bind_all: bool) -> int:
    """The run's redis-server in the foreground (AOF under the run folder, its password from the run's credentials
    file on stdin), until SIGTERM; every node of the job reaches it with ``bind_all``."""
    cfg = load_run_config(run_dir / "config.yaml")
    password = read_credentials(run_dir, cfg)[cfg.redis.password_env]
    args = redis_server_args(find_redis_server(cfg.redis.server_binary), port, run_dir / "redis")
    if bind_all:
        args[args.index("--bind") + 1] = "0.0.0.0"
    (run_dir / "redis").mkdir(exist_ok=True)
    env = server_environment(os.environ)  # none of the job's credentials
    proc = subprocess.Popen([*args, "--daemonize", "no", "-"], stdin=subprocess.PIPE, env=env)
    assert proc.stdin is not None
    proc.stdin.write(secret_config(password))
    proc.stdin.close()
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    return proc.wait()
