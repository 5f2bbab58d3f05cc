"""Time (and optionally profile) the trainer's step alone: Learner.rl_step on synthetic episodes of a given shape.

No services, no Redis: the real Learner on a real random-init model, fed episodes shaped like a task's
(groups x group size, prompt and completion lengths drawn from ranges). Prints the median step time, and with
``--profile`` the torch.profiler table of the operators where the time goes. Usage:

    python bench/trainer_step.py --model models/tiny --groups 8 --group-size 16 --prompt 5 6 --completion 2 3
    python bench/trainer_step.py --model models/seq4m --groups 8 --group-size 8 --completion 1 11 \\
        --set micro_batch_tokens=256 --profile
    # the SmolLM2 example's step (4 prompts x 8, ~55 + 24 tokens), full fine-tuning, with the process's peak RSS
    python bench/trainer_step.py --model models/smollm2-135m-instruct --groups 4 --group-size 8 --prompt 50 60 \\
        --completion 20 24 --steps 3 --memory --set micro_batch_size=32 --set optimizer.lr=0.000005
    # the same step as the example trains it (LoRA rank 16 on every projection), on two threads
    python bench/trainer_step.py --model models/smollm2-135m-instruct --groups 4 --group-size 8 --prompt 50 60 \\
        --completion 20 24 --steps 3 --lora 16 --threads 2 --set micro_batch_size=32

``--set KEY=VALUE`` sets a TrainerConfig field (dotted for sections, e.g. ``loss.policy_loss=gspo``).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from relayrl.common.model import load_model
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.lora import LoraConfig
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import TrainerConfig
from relayrl.trainer.batching import padded_tokens, plan_micro_batches
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the example's


def episodes(args: argparse.Namespace, vocab: int, seed: int) -> list[Episode]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(args.groups):
        n_p = int(torch.randint(args.prompt[0], args.prompt[1] + 1, (1,), generator=g))
        prompt = torch.randint(3, vocab, (n_p,), generator=g).tolist()
        for i in range(args.group_size):
            n_c = int(torch.randint(args.completion[0], args.completion[1] + 1, (1,), generator=g))
            out.append(
                Episode(
                    episode_id=f"{group}-{i}",
                    group_id=f"g{seed}-{group}",
                    group_size=args.group_size,
                    prompt_token_ids=prompt,
                    completion_token_ids=torch.randint(3, vocab, (n_c,), generator=g).tolist(),
                    behaviour_logprobs=(-torch.rand(n_c, generator=g) * 3).tolist(),
                    token_weight_versions=[1] * n_c,
                    loss_mask=[1] * n_c,
                    reward=float(torch.rand(1, generator=g) < 0.5),
                    sampling_temperature=1.0,
                )
            )
    return out


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def _set(cfg: Any, key: str, value: str) -> None:
    *path, last = key.split(".")
    for part in path:
        cfg = getattr(cfg, part)
    current = getattr(cfg, last)
    setattr(cfg, last, type(current)(value))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/tiny"))
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, nargs=2, default=(4, 6), metavar=("MIN", "MAX"))
    ap.add_argument("--completion", type=int, nargs=2, default=(2, 3), metavar=("MIN", "MAX"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lora", type=int, default=0, metavar="RANK", help="train a LoRA adapter of this rank (0: full)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--memory", action="store_true", help="print the process's peak RSS (after loading, warm-up, steps)"
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TrainerConfig()
    for item in args.overrides:
        _set(cfg, *item.split("=", 1))
    lora = (
        LoraConfig(enabled=True, rank=args.lora, alpha=2 * args.lora, target_modules=LORA_TARGETS)
        if args.lora
        else None
    )
    model = load_model(ModelConfig(path=args.model, lora=lora or LoraConfig()))
    vocab = int(model.config.vocab_size)
    learner = Learner(model, cfg, 0, torch.device("cpu"), max_completion_tokens=args.completion[1])
    batches = [episodes(args, vocab, seed) for seed in range(4)]
    peak = [_peak_rss_gb()]  # after loading the model
    for i in range(3):  # warm-up (the first step also allocates AdamW's moments)
        learner.rl_step(StepBatch.of(batches[i % len(batches)]))
    peak.append(_peak_rss_gb())
    times, cpu = [], []
    for i in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        learner.rl_step(StepBatch.of(batches[i % len(batches)]))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    params = sum(p.numel() for p in model.parameters())
    if args.memory:
        print(
            f"peak RSS {peak[0]:.2f} GB after loading, {peak[1]:.2f} GB after 3 warm-up steps, "
            f"{_peak_rss_gb():.2f} GB after {args.steps} more"
        )
    print(
        f"model {args.model} ({params / 1e6:.2f} M params), {len(batches[0])} episodes/step, "
        f"{args.threads} thread(s), overrides {args.overrides or 'none'}"
    )
    lengths = [len(e.prompt_token_ids) + len(e.completion_token_ids) - 1 for e in batches[0]]
    plan = plan_micro_batches(lengths, cfg.micro_batch_size, cfg.micro_batch_tokens)
    print(
        f"micro-batches {len(plan)}, positions computed {padded_tokens(lengths, plan)} "
        f"(real {sum(lengths)}, one batch padded to the longest {len(lengths) * max(lengths)})"
    )
    # CPU time of this process: less disturbed than wall time by other work on a shared machine (1 thread)
    print(
        f"step median wall {statistics.median(times) * 1e3:.1f} ms (p10 {sorted(times)[len(times) // 10] * 1e3:.1f}),"
        f" cpu {statistics.median(cpu) * 1e3:.1f} ms (p10 {sorted(cpu)[len(cpu) // 10] * 1e3:.1f})"
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(10):
                learner.rl_step(StepBatch.of(batches[i % len(batches)]))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))


if __name__ == "__main__":
    main()
