"""Padding share and trainer throughput of micro-batch layouts on one batch of mixed lengths (quick, CPU).

The real Learner on a random-init tiny model (created in a temporary folder), one batch of episodes whose
lengths vary widely (as in reasoning RL: some completions stop early, some run to the limit), timed with each
layout: the default (one micro-batch padded to the longest), split by sequences sorted by length, split by a
token budget, and packed rows (several sequences per row, no padding). Prints, per layout, micro-batches,
positions computed, padding share (1 - real positions / computed), median step wall and CPU time, and
trained tokens per second. Usage:

    python bench/packing.py                        # 32 episodes, completions 4..220 tokens, budget 1024
    python bench/packing.py --episodes 64 --budget 2048 --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from relayrl.common.model import load_model
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import MicroBatchLayout, TrainerConfig
from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model
from relayrl.trainer.batching import padded_tokens, plan_micro_batches, plan_packed
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner


def mixed_episodes(n: int, prompt: tuple[int, int], completion: tuple[int, int], vocab: int) -> list[Episode]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        n_p = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        n_c = int(torch.randint(completion[0], completion[1] + 1, (1,), generator=g))
        out.append(
            Episode(
                episode_id=str(i),
                group_id=f"g{i // 4}",
                group_size=4,
                prompt_token_ids=torch.randint(3, vocab, (n_p,), generator=g).tolist(),
                completion_token_ids=torch.randint(3, vocab, (n_c,), generator=g).tolist(),
                behaviour_logprobs=(-torch.rand(n_c, generator=g) * 3).tolist(),
                token_weight_versions=[1] * n_c,
                loss_mask=[1] * n_c,
                reward=float(torch.rand(1, generator=g)),
                sampling_temperature=1.0,
            )
        )
    return out


def layouts(budget: int, episodes: int) -> dict[str, TrainerConfig]:
    return {
        "one padded batch (default)": TrainerConfig(micro_batch_size=max(64, episodes)),
        "padded, 8 sequences sorted": TrainerConfig(micro_batch_size=8),
        f"padded, {budget}-token budget": TrainerConfig(micro_batch_tokens=budget),
        f"packed, {budget}-token rows": TrainerConfig(
            micro_batch_tokens=budget, micro_batch_layout=MicroBatchLayout.PACKED
        ),
    }


def computed_positions(cfg: TrainerConfig, lengths: list[int]) -> tuple[int, int]:
    """(micro-batches, positions the forward passes compute)."""
    if cfg.micro_batch_layout is MicroBatchLayout.PACKED:
        return len(plan_packed(lengths, cfg.micro_batch_tokens)), sum(lengths)
    plan = plan_micro_batches(lengths, cfg.micro_batch_size, cfg.micro_batch_tokens)
    return len(plan), padded_tokens(lengths, plan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--prompt", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"))
    ap.add_argument("--completion", type=int, nargs=2, default=(4, 220), metavar=("MIN", "MAX"))
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny_model(
            Path(tmp) / "tiny",
            TinyModelConfig(hidden_size=256, intermediate_size=512, num_layers=4, max_position_embeddings=512),
        )
        vocab = int(load_model(ModelConfig(path=model_dir)).config.vocab_size)
        batch = mixed_episodes(args.episodes, args.prompt, args.completion, vocab)
        lengths = [len(e.prompt_token_ids) + len(e.completion_token_ids) - 1 for e in batch]
        trained = sum(len(e.completion_token_ids) for e in batch)
        print(
            f"{len(batch)} episodes, sequence lengths {min(lengths)}..{max(lengths)} (real positions "
            f"{sum(lengths)}, trained tokens {trained}), {args.threads} thread(s), median of {args.steps} steps"
        )
        print(f"{'layout':32} {'micro':>5} {'computed':>9} {'padding':>8} {'wall ms':>8} {'cpu ms':>8} {'tok/s':>7}")
        for name, cfg in layouts(args.budget, len(batch)).items():
            model = load_model(ModelConfig(path=model_dir))
            learner = Learner(model, cfg, 0, torch.device("cpu"), max_completion_tokens=args.completion[1])
            learner.rl_step(StepBatch.of(batch))  # warm-up (the step's batch built in the loop, as the trainer does)
            wall, cpu = [], []
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                learner.rl_step(StepBatch.of(batch))
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            micro, computed = computed_positions(cfg, lengths)
            w, c = statistics.median(wall), statistics.median(cpu)
            print(
                f"{name:32} {micro:5d} {computed:9d} {1 - sum(lengths) / computed:8.1%} {w * 1e3:8.0f} "
                f"{c * 1e3:8.0f} {trained / w:7.0f}"
            )


if __name__ == "__main__":
    main()
