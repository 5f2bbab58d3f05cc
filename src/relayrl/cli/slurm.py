"""`relayrl slurm`: a run as one Slurm job (relayrl.launcher.slurm). ``submit`` writes the run folder and submits
its sbatch script (submitting the same folder again resumes the run); ``job`` and ``redis`` are what the job runs."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from relayrl.cli.args import add_overrides

NAME = "slurm"
HELP = "run on a Slurm cluster: write the run folder and submit its sbatch script (again: resume)"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True)
    submit = actions.add_parser("submit", help="write the run folder and sbatch its script")
    submit.add_argument("config", type=Path, help="run config YAML")
    add_overrides(submit)
    submit.add_argument("--out", type=Path, required=True, help="run folder, on a filesystem every node sees")
    submit.add_argument("--nodes", type=_positive, default=1, help="nodes of the job")
    submit.add_argument("--trainer-nodes", type=_positive, default=1, help="nodes of the trainer's torchrun")
    submit.add_argument("--nproc-per-node", type=_positive, default=1, help="trainer ranks on each of its nodes")
    submit.add_argument("--gpus-per-node", type=int, default=0, help="sbatch --gpus-per-node (0: none asked for)")
    for option in ("partition", "time", "account"):
        submit.add_argument(f"--{option}", default="", help=f"sbatch --{option}")
    submit.add_argument("--no-submit", action="store_true", help="write the folder and script only")
    job = actions.add_parser("job", help="(inside the job) place and run the services as srun steps")
    job.add_argument("run_dir", type=Path)
    redis = actions.add_parser("redis", help="(inside the job) the run's redis-server")
    redis.add_argument("run_dir", type=Path)
    redis.add_argument("--port", type=int, required=True)
    redis.add_argument("--bind-all", action="store_true", help="listen on every interface (a job of several nodes)")


def run(args: argparse.Namespace) -> int:
    if args.action == "job":
        from relayrl.launcher.slurm_job import run_job

        return run_job(args.run_dir.resolve())
    if args.action == "redis":
        from relayrl.launcher.slurm_job import serve_redis

        return serve_redis(args.run_dir.resolve(), args.port, args.bind_all)
    from relayrl.config import load_run_config
    from relayrl.config.typed import ConfigError
    from relayrl.launcher.slurm import SlurmPlan, prepare

    if args.trainer_nodes > args.nodes:
        raise ConfigError("--trainer-nodes", args.trainer_nodes, f"must be <= --nodes ({args.nodes})")
    plan = SlurmPlan(
        args.nodes, args.trainer_nodes, args.nproc_per_node, args.gpus_per_node, args.partition, args.time, args.account
    )
    script = prepare(load_run_config(args.config, args.overrides), plan, args.out)
    print(f"relayrl: run folder {script.parent}; sbatch script {script}")
    if args.no_submit:
        return 0
    return subprocess.run(["sbatch", "--parsable", str(script)], check=False).returncode
