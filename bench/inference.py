"""Generation throughput and latency: the native engine vs HF `generate` (padded batches) vs vLLM, one invocation.

All engines serve the same 64 requests (seeded mix of prompt lengths 4-64 and output lengths 8-128 tokens,
``ignore_eos`` so every engine produces exactly the requested tokens) on the same tiny model, all submitted at
once. HF `generate` runs them in arrival order in left-padded batches of ``--hf-batch``; each batch runs until
its longest request is done. vLLM runs in its own virtual environment (scripts/setup_vllm_env.sh) as a
subprocess of this script, when that environment exists. Prints tokens/s (requested output tokens / wall time),
p50/p99 request latency, and ratios to the HF baseline measured in the same run. Usage:

    python bench/inference.py [--requests 64] [--hf-batch 16] [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(4, 64))], rng.randint(8, 128)) for _ in range(n)]


def _summary(name: str, wall: float, latencies: list[float], tokens: int) -> dict[str, Any]:
    lat = sorted(latencies)
    return {
        "engine": name,
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "p50_s": statistics.median(lat),
        "p99_s": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
        "tokens": tokens,
    }


def bench_engine(name: str, engine: Any, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    from relayrl.inference.engine import GenerationInput, generate

    generate(engine, [GenerationInput(prompt_ids=p, max_new_tokens=8, ignore_eos=True) for p, _ in reqs[:8]])  # warm
    done: dict[int, float] = {}
    t0 = time.perf_counter()
    futures = [engine.submit(GenerationInput(prompt_ids=p, max_new_tokens=m, ignore_eos=True)) for p, m in reqs]
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _f, i=i: done.__setitem__(i, time.perf_counter()))
    outs = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    tokens = sum(len(o[0].token_ids) for o in outs)
    assert tokens == sum(m for _, m in reqs), "an engine produced other lengths than requested"
    return _summary(name, wall, [done[i] - t0 for i in range(len(reqs))], tokens)


def bench_hf(model: Any, tokenizer: Any, reqs: list[tuple[list[int], int]], batch: int) -> dict[str, Any]:
    pad = int(tokenizer.pad_token_id)

    def run(chunk: list[tuple[list[int], int]]) -> None:
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (p, _) in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        steps = max(m for _, m in chunk)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                max_new_tokens=steps,
                min_new_tokens=steps,
                pad_token_id=pad,
                top_k=0,
                top_p=1.0,
            )

    run(reqs[:8])  # warm-up
    latencies: list[float] = []
    t0 = time.perf_counter()
    for start in range(0, len(reqs), batch):
        chunk = reqs[start : start + batch]
        run(chunk)
        latencies += [time.perf_counter() - t0] * len(chunk)
    wall = time.perf_counter() - t0
    return _summary(f"hf_generate(batch={batch})", wall, latencies, sum(m for _, m in reqs))


def make_model(out: Path) -> Path:
    from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model

    cfg = TinyModelConfig(
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_position_embeddings=512,
        seed=0,
    )
    return create_tiny_model(out, cfg)


def run_vllm(python: str, model_dir: Path, reqs: int) -> dict[str, Any] | None:
    if not Path(python).exists():
        print(f"vllm: {python} not found, skipped (create it with scripts/setup_vllm_env.sh)", file=sys.stderr)
        return None
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
    proc = subprocess.run(
        [python, __file__, "--only-vllm", "--model", str(model_dir), "--requests", str(reqs)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        print(f"vllm run failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: a fresh tiny model)")
    parser.add_argument("--only-vllm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    from relayrl.common.model import load_model, load_tokenizer
    from relayrl.config.inference import EngineKind, InferenceConfig
    from relayrl.config.model import ModelConfig

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_model(Path(tmp) / "model")
        tokenizer = load_tokenizer(model_dir)
        reqs = workload(args.requests, len(tokenizer))
        if args.only_vllm:
            from relayrl.inference.vllm_engine import VllmEngine

            engine = VllmEngine(ModelConfig(path=model_dir), InferenceConfig(engine=EngineKind.VLLM))
            print(json.dumps(bench_engine("vllm-cpu", engine, reqs)))
            engine.close()
            return 0
        from relayrl.inference.native import NativeEngine

        results = [bench_hf(load_model(ModelConfig(path=model_dir)), tokenizer, reqs, args.hf_batch)]
        native = NativeEngine(load_model(ModelConfig(path=model_dir)), tokenizer, torch.device("cpu"))
        results.append(bench_engine("native", native, reqs))
        native.close()
        vllm = run_vllm(args.vllm_python, model_dir, args.requests)
        if vllm is not None:
            results.append(vllm)
    base = results[0]["tokens_per_s"]
    print(f"{args.requests} requests, {results[0]['tokens']} output tokens, torch threads {torch.get_num_threads()}")
    print(f"{'engine':<22}{'tokens/s':>10}{'p50 s':>9}{'p99 s':>9}{'vs HF':>8}")
    for r in results:
        print(
            f"{r['engine']:<22}{r['tokens_per_s']:>10.0f}{r['p50_s']:>9.2f}{r['p99_s']:>9.2f}"
            f"{r['tokens_per_s'] / base:>7.2f}x"
        )
    if vllm is not None:
        print(f"native / vllm-cpu: {results[1]['tokens_per_s'] / vllm['tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
