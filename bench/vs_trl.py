"""relayrl vs Hugging Face TRL's GRPOTrainer on the same task, model, data and settings, in one invocation.

Builds the task's random-init model once (``save_pretrained``; both load that directory), then runs TRL's
``GRPOTrainer`` (bench/trl_grpo.py, in a subprocess with TRL's default torch threads) and ``relayrl run`` (the
launcher, in a subprocess), one after the other, for the same number of optimizer steps. Every shared setting
comes from ONE place, the task's relayrl run config (plus ``--set`` overrides): :func:`trl_kwargs` maps it onto
``GRPOConfig``. Prints for each: time and steps to the 10-step-mean reward thresholds (0.8 and 0.9 of the task's
maximum), steps/s, generated tokens/s, final reward (mean of the last 10 steps), wall time with start-up; then the
ratios relayrl / TRL. Writes ``<out>/<task>/summary.json``.

Clocks. TRL: from ``on_train_begin`` (model, tokenizer, data and TRL already loaded) to the ``on_log`` of each
step, so it includes every step's generation, scoring, training and TRL's logging. relayrl: from the start of
the trainer's first step (``time_s - step_time_s`` of metrics row 1: the first batch is in hand) to the time the
step's row is written (after the weights are published and verified), so it excludes service start-up and the
generation of the first batch, and includes everything after. Wall time: from launching the subprocess to its
exit, for both.

Seeds. ``--seeds 0,1,2`` runs both systems once per seed (TRL then relayrl for each seed, alternated, so a change
in the machine's speed reaches both), each with that ``seed`` for sampling, data order and initialisation of
anything random (the model stays the one saved directory), and ends with the mean of every figure per system over
the seeds and the ratios of those means. One run per system says little about the final reward: TRL's own spreads
over several hundredths between seeds, relayrl's also between runs of one seed (its asynchrony decides which
weights generate which group).

    python bench/vs_trl.py [--task quickstart|sequence|sequence32|smollm2-lora] [--steps N] [--out runs/vs_trl]
                           [--set k=v ...] [--seeds 0,1,2] [--skip-trl] [--skip-relayrl]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relayrl.common.metrics_row import read_rows, rl_rows
from relayrl.config.loss import AdvantageEstimator, LossAggregation, MismatchMask, PolicyLoss
from relayrl.config.optimizer import LrSchedule, OptimizerName
from relayrl.config.run import RunConfig, load_run_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from curves import Result, StepRow, mean_result, report, summarise

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Task:
    config: str  # relayrl run config, relative to the repository
    model: dict[str, Any]  # TinyModelConfig fields of the random-init model
    steps: int  # default optimizer steps
    max_reward: float = 1.0
    dataset_maker: str = ""  # "module:function(path)" that writes the dataset when it is missing
    model_dir: str = ""  # a pretrained model both load (relative to the repository); empty: built from ``model``


TASKS = {
    "quickstart": Task("examples/quickstart.yaml", {}, steps=400),
    "sequence": Task(
        "examples/sequence.yaml",
        {"hidden_size": 384, "intermediate_size": 1024, "num_layers": 3, "num_heads": 6, "num_kv_heads": 2},
        steps=100,
        dataset_maker="relayrl.tasks.sequence:make_dataset",
    ),
    "sequence32": Task(
        "examples/sequence32.yaml",
        {"hidden_size": 384, "intermediate_size": 1024, "num_layers": 3, "num_heads": 6, "num_kv_heads": 2},
        steps=100,
        dataset_maker="relayrl.tasks.sequence:make_long_dataset",
    ),
    # the packaged SmolLM2-135M-Instruct (make example-model), LoRA r16 and its chat template on both sides
    "smollm2-lora": Task(
        "examples/smollm2_lora.yaml",
        {},
        steps=20,
        dataset_maker="relayrl.tasks.chat_addition:make_train_split",
        model_dir="models/smollm2-135m-instruct",
    ),
}


def relayrl_step_rows(metrics: Path) -> list[StepRow]:
    """The RL rows of a relayrl metrics.jsonl on the clock that starts with the first trainer step."""
    rl = rl_rows(read_rows(metrics))
    if not rl:
        return []
    origin = rl[0].time_s - rl[0].step_time_s
    return [StepRow(r.step, r.time_s - origin, r.reward_mean, r.episodes * r.completion_len_mean) for r in rl]


def run_overrides(task: Task, model_dir: Path, steps: int, user: list[str]) -> list[str]:
    """The overrides the bench applies to the task's config (the user's last, so they win): no checkpoints and no
    in-run evaluation (TRL's timed run has neither)."""
    fixed = [f"model.path={model_dir}", f"trainer.total_steps={steps}", "trainer.checkpoint.every=0"]
    return [*fixed, "trainer.eval.every_steps=0", *user]


def trl_kwargs(cfg: RunConfig, steps: int, output_dir: Path) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments equivalent to a relayrl run config (ValueError where TRL has none)."""
    tc, rc, loss = cfg.trainer, cfg.rollout, cfg.trainer.loss
    if (
        loss.advantage not in (AdvantageEstimator.GRPO, AdvantageEstimator.DR_GRPO)
        or loss.effective_policy_loss() is not PolicyLoss.PPO_CLIP
        or loss.mismatch_mask is not MismatchMask.NONE
        or loss.kl_coef > 0
        or loss.overlong_buffer_tokens > 0
    ):
        raise ValueError(
            "TRL's GRPOTrainer has no equivalent of this loss.advantage, policy_loss (or off_policy), "
            "mismatch_mask, kl_coef or overlong penalty as relayrl applies them"
        )
    if cfg.model.dtype != "float32" or cfg.model.device != "cpu":
        raise ValueError("the comparison runs float32 on the CPU")
    opt = tc.optimizer
    if opt.name is not OptimizerName.ADAMW or opt.schedule is not LrSchedule.CONSTANT:
        raise ValueError(
            "the comparison mirrors trainer.optimizer name adamw with schedule constant (TRL's decaying "
            "schedules end one step earlier than relayrl's)"
        )
    return {
        "output_dir": str(output_dir),
        "max_steps": steps,
        "seed": cfg.seed,
        "data_seed": cfg.rollout.seed,
        "learning_rate": opt.lr,
        "adam_beta1": opt.beta1,
        "adam_beta2": opt.beta2,
        "weight_decay": opt.weight_decay,
        "max_grad_norm": opt.grad_clip,
        "warmup_steps": opt.warmup_steps,
        "lr_scheduler_type": "constant_with_warmup" if opt.warmup_steps else "constant",
        # one optimizer step per generation batch of groups_per_step prompts x group_size samples
        "per_device_train_batch_size": tc.groups_per_step * rc.group_size,
        "gradient_accumulation_steps": 1,
        "num_generations": rc.group_size,
        "max_completion_length": rc.max_new_tokens,
        "temperature": rc.temperature,
        "top_p": rc.top_p,
        "top_k": rc.top_k,
        "epsilon": loss.clip_eps,
        "epsilon_high": loss.clip_high(),
        "beta": 0.0,
        "num_iterations": 1,
        "scale_rewards": "group" if loss.advantage is AdvantageEstimator.GRPO else "none",
        "loss_type": {LossAggregation.TOKEN_MEAN: "dapo", LossAggregation.SEQUENCE_MEAN: "grpo"}.get(
            loss.loss_aggregation, "dr_grpo"
        ),
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "use_cpu": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def lora_kwargs(cfg: RunConfig) -> dict[str, Any] | None:
    """peft ``LoraConfig`` arguments of the run's adapter (None: relayrl trains every weight)."""
    lora = cfg.model.lora
    if not lora.enabled:
        return None
    return {
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": lora.target_modules,
    }


def ensure_inputs(task: Task, cfg_path: Path, model_dir: Path) -> None:
    """The random-init model (made once, reused by both systems) and the dataset."""
    from relayrl.config.typed import from_dict
    from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model

    if task.model_dir and not (model_dir / "config.json").exists():
        raise SystemExit(f"{model_dir} does not exist: make example-model")
    if not (model_dir / "config.json").exists():
        create_tiny_model(model_dir, from_dict(TinyModelConfig, dict(task.model)))
    dataset = REPO / load_run_config(cfg_path).rollout.dataset
    if task.dataset_maker and not dataset.exists():
        module, fn = task.dataset_maker.split(":")
        getattr(importlib.import_module(module), fn)(dataset)


def _run_logged(cmd: list[str], log_path: Path) -> None:
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed with exit code {proc.returncode}; see {log_path}")


def model_parameters(model_dir: Path) -> int:
    """Parameters of the saved model, counted from its safetensors header (no torch load)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def run_trl(cfg: RunConfig, steps: int, model_dir: Path, out: Path, max_reward: float) -> Result:
    if importlib.util.find_spec("trl") is None:
        raise SystemExit(
            "TRL is not installed: pip install -e '.[bench]' (pinned TRL, keeps the CPU torch), or pass --skip-trl"
        )
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = {
        "model": str(model_dir),
        "dataset": str(REPO / cfg.rollout.dataset),
        "reward": cfg.reward.function,
        "reward_params": cfg.reward.params,
        "lora": lora_kwargs(cfg),
        "rows": str(out / "rows.jsonl"),
        "kwargs": trl_kwargs(cfg, steps, out / "trainer"),
    }
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    t0 = time.perf_counter()
    _run_logged([sys.executable, str(REPO / "bench" / "trl_grpo.py"), str(out / "spec.json")], out / "log.txt")
    wall = time.perf_counter() - t0
    rows = [StepRow(**json.loads(line)) for line in (out / "rows.jsonl").read_text().splitlines()]
    return summarise("TRL", rows, wall, max_reward)


def run_relayrl(cfg_path: Path, overrides: list[str], out: Path, max_reward: float) -> Result:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "relayrl.cli",
        "run",
        str(cfg_path),
        "--out",
        str(out),
        *[x for o in overrides for x in ("--set", o)],
    ]
    t0 = time.perf_counter()
    _run_logged(cmd, out / "launcher.txt")
    wall = time.perf_counter() - t0
    return summarise("relayrl", relayrl_step_rows(out / "metrics.jsonl"), wall, max_reward)


def run_seed(
    args: argparse.Namespace, task: Task, model_dir: Path, out: Path, steps: int, seed: int | None
) -> list[Result]:
    """Both systems (unless skipped) on one seed (None: the config's); results under ``out``."""
    cfg_path = REPO / task.config
    seed_set = [f"seed={seed}"] if seed is not None else []
    overrides = run_overrides(task, model_dir, steps, [*args.overrides, *seed_set])
    cfg = load_run_config(cfg_path, overrides)
    results = []
    if not args.skip_trl:
        results.append(run_trl(cfg, steps, model_dir, out / "trl", task.max_reward))
    if not args.skip_relayrl:
        results.append(run_relayrl(cfg_path, overrides, out / "relayrl", task.max_reward))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="quickstart")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps (default: the task's)")
    parser.add_argument("--out", type=Path, default=Path("runs/vs_trl"))
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="relayrl config override; shared settings (batch, lr, tokens, ...) reach TRL too",
    )
    parser.add_argument(
        "--seeds",
        default="",
        help="comma-separated seeds: one run of each system per seed, "
        "then the means (default: the config's seed, one run each)",
    )
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-relayrl", action="store_true")
    args = parser.parse_args(argv)
    task = TASKS[args.task]
    steps = args.steps or task.steps
    out = (args.out / args.task).resolve()
    model_dir = REPO / task.model_dir if task.model_dir else out / "model"
    cfg_path = REPO / task.config
    ensure_inputs(task, cfg_path, model_dir)
    overrides = run_overrides(task, model_dir, steps, args.overrides)
    cfg = load_run_config(cfg_path, overrides)
    rc = cfg.rollout
    seeds: list[int | None] = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    load_before = os.getloadavg()
    print(
        f"task {args.task}: {model_parameters(model_dir) / 1e6:.2f} M parameters, {steps} steps of "
        f"{cfg.trainer.groups_per_step} prompts x {rc.group_size} samples, max_new_tokens {rc.max_new_tokens}, "
        f"lr {cfg.trainer.optimizer.lr:g}; load average {load_before[0]:.2f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    runs: list[tuple[int, list[Result]]] = []
    for seed in seeds:
        results = run_seed(args, task, model_dir, out if seed is None else out / f"seed{seed}", steps, seed)
        runs.append((cfg.seed if seed is None else seed, results))
        if len(seeds) > 1:
            print(f"seed {runs[-1][0]}:\n{report(results, task.max_reward)}", flush=True)
    by_system = list(zip(*(results for _, results in runs), strict=True))
    final = [r[0] for r in by_system] if len(seeds) == 1 else [mean_result(r[0].system, list(r)) for r in by_system]
    load_after = os.getloadavg()
    if len(seeds) > 1:
        print(f"mean over seeds {', '.join(str(seed) for seed, _ in runs)}:")
    print(report(final, task.max_reward))
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    (out / "summary.json").write_text(
        json.dumps(
            {
                "task": args.task,
                "steps": steps,
                "overrides": overrides,
                "load_average": [load_before, load_after],
                "results": [asdict(r) for r in final],
                "runs": [{"seed": seed, "results": [asdict(r) for r in results]} for seed, results in runs],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
