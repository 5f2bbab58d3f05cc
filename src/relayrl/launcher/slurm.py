"""A run as one Slurm job (`relayrl slurm`): :func:`prepare` writes the run folder (the run config, the credentials
as files readable by their owner only, the sbatch script) and the job itself runs :func:`run_job`, which places the
services on the job's nodes as ``srun`` steps: Redis (AOF under the run folder), reward, the inference replicas (one
node after the other), a torchrun trainer over the first ``trainer_nodes`` nodes and rollout, each waited for until
healthy. When the trainer finishes, the others stop, the summary is written and Redis stops last.

``scancel`` stops everything: Slurm sends SIGTERM to every step, each service stops at its safe point (the trainer
acknowledges only durable groups, the rest stay pending in Redis's AOF) and SIGKILL follows after Slurm's KillWait.
Submitting the same script again resumes: the same Redis files, the newest checkpoint, rollout's state.

The folder is on a filesystem every node of the job sees (the usual home or project filesystem of a cluster).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from relayrl.common.credentials import service_environment
from relayrl.config import RunConfig, dump_run_config, load_run_config
from relayrl.config.endpoints import ServerConfig
from relayrl.config.files import write_private
from relayrl.config.inference import ReplicaEndpoint
from relayrl.config.model_fit import fit_to_model
from relayrl.config.publication import WeightTransport
from relayrl.launcher.summary import write_summary
from relayrl.local_redis import free_ports

PLAN_FILE, SCRIPT_FILE, JOB_CONFIG = "slurm.json", "relayrl.sbatch", "job-config.yaml"
CREDENTIALS = {"control": "control_token", "weights": "weights_token", "code": "code_token", "redis": "redis_password"}
HEALTHY_WITHIN_S = 600.0


@dataclass(frozen=True)
class SlurmPlan:
    """The job's shape: ``nodes`` in all, the trainer's torchrun over the first ``trainer_nodes`` of them with
    ``nproc_per_node`` ranks each, and what sbatch is asked for."""

    nodes: int = 1
    trainer_nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    partition: str = ""
    time: str = ""
    account: str = ""


def prepare(cfg: RunConfig, plan: SlurmPlan, run_dir: Path) -> Path:
    """The run folder of a Slurm run: its config, credentials (kept across submissions) and sbatch script."""
    cfg.model.check_exists()
    cfg = fit_to_model(cfg)
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True, mode=cfg.folder_mode())
    (run_dir / "logs").mkdir(exist_ok=True, mode=cfg.folder_mode())
    folder = run_dir / "credentials"
    folder.mkdir(mode=0o700, exist_ok=True)
    for name in CREDENTIALS.values():
        if not (folder / name).is_file():  # a resubmission keeps them: Redis's password is in its AOF's world
            write_private(folder / name, secrets.token_urlsafe(32) + "\n")
    world = plan.trainer_nodes * plan.nproc_per_node
    trainer = replace(cfg.trainer, distributed=replace(cfg.trainer.distributed, world_size=world))
    trainer = replace(trainer, checkpoint=replace(trainer.checkpoint, resume="auto"))  # a resubmission resumes
    model = replace(cfg.model, path=cfg.model.path.resolve())  # the job may start in another folder
    rollout = replace(cfg.rollout, dataset=cfg.rollout.dataset.resolve())
    dump_run_config(
        replace(cfg, output_dir=run_dir, trainer=trainer, model=model, rollout=rollout), run_dir / "config.yaml"
    )
    write_private(run_dir / PLAN_FILE, json.dumps(asdict(plan)) + "\n")
    script = run_dir / SCRIPT_FILE
    write_private(script, sbatch_script(plan, run_dir, cfg.name))
    return script


def sbatch_script(plan: SlurmPlan, run_dir: Path, name: str) -> str:
    options = [f"--job-name=relayrl-{name}", f"--nodes={plan.nodes}", f"--output={run_dir}/logs/slurm-%j.out"]
    options += ["--open-mode=append", "--ntasks-per-node=1"]
    if plan.gpus_per_node:
        options.append(f"--gpus-per-node={plan.gpus_per_node}")
    options += [f"--{key}={value}" for key in ("partition", "time", "account") if (value := getattr(plan, key))]
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in options), "# relayrl slurm: every service of the run as a step"]
    return "\n".join([*lines, f"exec {sys.executable} -m relayrl.cli slurm job {run_dir}", ""])


def job_nodes() -> list[str]:
    """The job's node names, in Slurm's order."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return out.stdout.split()


def _on(server: ServerConfig, node: str, port: int, spread: bool) -> ServerConfig:
    return replace(server, host="0.0.0.0" if spread else "127.0.0.1", port=port, address=f"{node}:{port}")


def place(cfg: RunConfig, nodes: list[str]) -> tuple[RunConfig, dict[str, str]]:
    """``cfg`` with every server on its node: Redis, reward, rollout, the trainer's rank 0 and the first inference
    replica on the first node (free ports there), replica i on node i mod len(nodes) at its configured ports + 2i.
    Returns the config and each inference replica's node."""
    head, spread = nodes[0], len(nodes) > 1
    ports = iter(free_ports(10))
    ic = cfg.inference
    ic = replace(
        ic,
        server=_on(ic.server, head, next(ports), spread),
        weights_server=_on(ic.weights_server, head, next(ports), spread),
        http=replace(ic.http, port=next(ports)),
    )
    where = {"inference-1": head}
    endpoints = [ReplicaEndpoint(ic.server.target, ic.weights_server.target)]
    for i in range(1, ic.replicas):
        node = nodes[i % len(nodes)]
        own = (ic.server.port + 2 * i, ic.server.port + 2 * i + 1)  # another node: the configured ports, moved
        grpc, weights = (next(ports), next(ports)) if node == head else own
        endpoints.append(ReplicaEndpoint(f"{node}:{grpc}", f"{node}:{weights}"))
        where[f"inference-{i + 1}"] = node
    pc = cfg.trainer.publication
    if pc.transport is WeightTransport.AUTO:  # one node: the run folder; several: over gRPC
        pc = replace(pc, transport=WeightTransport.GRPC_STREAM if spread else WeightTransport.SHARED_MEMORY)
    return (
        replace(
            cfg,
            redis=replace(cfg.redis, url=f"redis://{head}:{next(ports)}/0"),
            inference=replace(ic, endpoints=endpoints if ic.replicas > 1 else []),
            reward=replace(cfg.reward, server=_on(cfg.reward.server, head, next(ports), spread)),
            rollout=replace(cfg.rollout, server=_on(cfg.rollout.server, head, next(ports), spread)),
            trainer=replace(cfg.trainer, server=_on(cfg.trainer.server, head, next(ports), spread), publication=pc),
        ),
        where,
    )


def read_credentials(run_dir: Path, cfg: RunConfig) -> dict[str, str]:
    """The run's credentials from its files, by the environment variable each service reads."""
    c = cfg.control
    names = {"control": c.token_env, "weights": c.weights_token_env, "code": c.code_token_env}
    names["redis"] = cfg.redis.password_env
    return {names[k]: (run_dir / "credentials" / f).read_text().strip() for k, f in CREDENTIALS.items()}


def load_job(run_dir: Path) -> tuple[RunConfig, SlurmPlan]:
    return load_run_config(run_dir / "config.yaml"), SlurmPlan(**json.loads((run_dir / PLAN_FILE).read_text()))


def step_ids() -> dict[str, str]:
    """The job's running steps by name: ``JOB.STEP`` ids (squeue)."""
    out = subprocess.run(
        ["squeue", "-h", "-s", "-j", os.environ["SLURM_JOB_ID"], "-o", "%i %j"], capture_output=True, text=True
    )
    return {name: step for step, _, name in (line.partition(" ") for line in out.stdout.splitlines())}


def stop_steps(steps: dict[str, subprocess.Popen[bytes]], names: list[str], wait_s: float) -> None:
    """SIGTERM to the tasks of each step (``scancel --signal``: a signal to srun itself would end its step with
    SIGKILL), then wait for its srun; SIGKILL what is left after ``wait_s``."""
    running = [n for n in names if n in steps and steps[n].poll() is None]
    ids = step_ids() if running else {}
    for name in running:
        if name in ids:
            subprocess.run(["scancel", "--signal=TERM", ids[name]], check=False, timeout=30)
        else:
            steps[name].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    for name in names:
        if name in steps:
            try:
                steps[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                steps[name].kill()
                steps[name].wait()


def summarise(cfg: RunConfig, run_dir: Path, password: str) -> None:
    write_summary(cfg, run_dir, password, print, {})


def step_env(service: str, cfg: RunConfig, creds: dict[str, str]) -> dict[str, str]:
    """A step's environment: only the credentials ``service`` holds (relayrl.common.credentials)."""
    env = service_environment(
        service, os.environ, creds, cfg.control, cfg.redis, in_run_eval=cfg.trainer.eval.every_steps > 0
    )
    return {**env, "PYTHONUNBUFFERED": "1"}
