"""Weight publication, phase by phase: snapshot, serialise (+ checksum), transfer, assemble (checksum, finite
check), swap, probe — for each transport, on a model directory, against a real inference weights server.

The inference server (native engine, its gRPC weights port on loopback) runs in this process, as in the
integration tests; the trainer side is the project's ``WeightPublisher``. Each configuration pushes ``--pushes``
versions (each a fresh perturbation of the weights) after one warm-up push and prints the median of each phase
(seconds) and of the whole publication, and ``cpu``: the CPU seconds the process (both sides) spent on it, which is
what the wall time comes down to on an idle machine and varies far less with the load of a shared one; then the
same building blocks timed alone. Usage:

    python bench/publish.py MODEL_DIR [--pushes 10] [--transports grpc_stream shared_path shared_memory]
        [--probe-sequences 4] [--probe-tokens 32] [--dtype float32|bfloat16] [--lora-rank R] [--probe-every N]
        [--engines native vllm] [--device cpu|cuda]

``--device cuda``: both sides hold the model on the GPU (the trainer snapshots it off the GPU, inference copies the
update onto it and probes there); the building blocks are timed on the CPU only.

``--lora-rank``: both sides hold base + a LoRA adapter of that rank (model.lora defaults otherwise) and each
publication carries the adapter only. ``--engines``: the inference engines to publish to, each in turn (vllm: in
the vLLM environment, scripts/setup_vllm_env.sh; it cannot confirm the served weights, so every push is probed);
with two or more, each engine's total is also printed as a ratio to the first one's, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch


def _median_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _serve(model_dir: Path, weights_dir: Path, mcfg: Any, engine_kind: str) -> tuple[Any, Any, Any]:
    from relayrl.common.lora import with_lora
    from relayrl.common.model import load_model, load_tokenizer
    from relayrl.config.control import ControlConfig
    from relayrl.config.inference import EngineKind, InferenceConfig
    from relayrl.inference.native import NativeEngine
    from relayrl.inference.server import create_inference_servers
    from relayrl.inference.serving import InferenceService

    d = InferenceConfig()
    cfg = InferenceConfig(
        engine=EngineKind(engine_kind),
        server=replace(d.server, port=0),
        weights_server=replace(d.weights_server, port=0),
    )
    tokenizer = load_tokenizer(model_dir)
    engine: Any
    if cfg.engine is EngineKind.VLLM:
        from relayrl.inference.vllm_engine import VllmEngine

        engine = VllmEngine(mcfg, cfg)
    else:
        model = load_model(mcfg)
        engine = NativeEngine(
            with_lora(model, mcfg.lora) if mcfg.lora.enabled else model, tokenizer, torch.device(mcfg.device)
        )
    service = InferenceService(
        cfg,
        engine,
        tokenizer,
        str(model_dir),
        weights_dir=weights_dir,
        weights_token=ControlConfig().effective_weights_token(),
    )
    main, weights = create_inference_servers(service)
    await main.start()
    await weights.start()
    return service, main, weights


async def bench_transport(
    model_dir: Path,
    transport: str,
    pushes: int,
    probe_shape: tuple[int, int],
    mcfg: Any,
    probe_every: int = 1,
    engine_kind: str = "native",
) -> dict[str, float]:
    from relayrl.common.model import load_tokenizer
    from relayrl.config.control import ControlConfig
    from relayrl.config.publication import WeightTransport
    from relayrl.trainer.lora import load_policy
    from relayrl.trainer.transports import make_transport
    from relayrl.trainer.weight_sync import WeightPublisher

    with tempfile.TemporaryDirectory() as tmp:
        weights_dir = Path(tmp) / "weights"
        service, main, weights = await _serve(model_dir, weights_dir, mcfg, engine_kind)
        try:
            model = load_policy(mcfg)  # as the trainer builds it: with LoRA, only the adapter is trained
            probe = WeightPublisher.default_probe(model, load_tokenizer(model_dir), *probe_shape, seed=0)
            pub = WeightPublisher(
                model,
                torch.device(mcfg.device),
                service.weights_target,
                make_transport(WeightTransport(transport), 2 * 1024 * 1024, weights_dir),
                60.0,
                probe,
                None,
                token=ControlConfig().effective_weights_token(),
                probe_every=probe_every,
            )
            rows: list[dict[str, float]] = []
            for version in range(1, pushes + 2):
                with torch.no_grad():
                    for p in model.parameters():
                        if p.requires_grad:
                            p.add_(1e-3 * torch.randn_like(p))
                t0, cpu0 = time.perf_counter(), time.process_time()
                params = pub.snapshot()
                snap = time.perf_counter() - t0
                result = await pub.push(params, version)
                t = getattr(result, "timings", None)
                # cpu: CPU seconds of this process (trainer and inference sides, every thread) for the publication,
                # what its wall time comes down to on an idle machine (the work is serial, one thread at a time)
                row = {"snapshot": snap, "total": snap + result.seconds, "cpu": time.process_time() - cpu0}
                if t is not None:
                    row.update(serialise=t.serialise_s, transfer=t.transfer_s, swap=t.swap_s, probe=t.probe_s)
                if version > 1:  # the first push warms up the channel and the allocator
                    rows.append(row)
            return {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        finally:
            await main.stop(0)
            await weights.stop(0)
            service.engine.close()


def building_blocks(model_dir: Path, probe_shape: tuple[int, int]) -> dict[str, float]:
    from relayrl.common.model import load_model, load_tokenizer
    from relayrl.common.pb.inference_pb2 import CHECKSUM_ALGORITHM_XXH3_128
    from relayrl.common.probe import probe_logprobs
    from relayrl.common.tensor_views import packed_copy
    from relayrl.common.weights import check_finite, checksum, iter_update_messages
    from relayrl.config.model import ModelConfig
    from relayrl.trainer.weight_files import write_mapped
    from relayrl.trainer.weight_sync import WeightPublisher

    model = load_model(ModelConfig(path=model_dir)).eval()
    params = {n: p.detach() for n, p in model.named_parameters()}
    probe = WeightPublisher.default_probe(model, load_tokenizer(model_dir), *probe_shape, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.safetensors"
        return {
            "snapshot (packed copy)": _median_time(lambda: packed_copy(params)),
            "checksum (sha256)": _median_time(lambda: checksum(params)),
            "checksum (xxh3_128)": _median_time(lambda: checksum(params, CHECKSUM_ALGORITHM_XXH3_128)),
            "finite check": _median_time(lambda: check_finite(params)),
            "grpc chunks + manifest": _median_time(lambda: list(iter_update_messages(params, 1, 2 * 1024 * 1024))),
            "mapped file write + hash": _median_time(lambda: write_mapped(params, 1, probe, path)),
            "probe forward": _median_time(lambda: probe_logprobs(model, probe, torch.device("cpu"))),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--pushes", type=int, default=10)
    ap.add_argument("--transports", nargs="+", default=["grpc_stream", "shared_path", "shared_memory"])
    ap.add_argument("--probe-sequences", type=int, default=4)
    ap.add_argument("--probe-tokens", type=int, default=32)
    ap.add_argument(
        "--probe-every",
        type=int,
        default=1,
        help="trainer.publication.probe_every: 1 probes every push; 0 only the warm-up push, the others "
        "verified by the served-weights check alone",
    )
    ap.add_argument("--no-blocks", action="store_true", help="skip timing the building blocks alone")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--lora-rank", type=int, default=0, help="publish a LoRA adapter of this rank (0: full weights)")
    ap.add_argument("--engines", nargs="+", choices=("native", "vllm"), default=["native"])
    ap.add_argument("--device", default="cpu", help="torch device of both sides: cpu, cuda or cuda:N")
    args = ap.parse_args()
    from relayrl.config.lora import LoraConfig
    from relayrl.config.model import ModelConfig

    mcfg = ModelConfig(
        path=args.model_dir,
        dtype=args.dtype,
        device=args.device,
        lora=LoraConfig(enabled=args.lora_rank > 0, rank=max(args.lora_rank, 1)),
    )
    os.environ.setdefault("RELAYRL_WEIGHTS_TOKEN", secrets.token_urlsafe(32))  # both sides read it from here
    probe_shape = (args.probe_sequences, args.probe_tokens)
    from safetensors import safe_open

    n = 0
    for shard in sorted(args.model_dir.glob("*.safetensors")):  # one file, or the shards of a large model
        with safe_open(str(shard), "pt") as f:
            n += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (no __iter__)
    print(
        f"model {args.model_dir} ({n / 1e6:.2f} M tensor elements), {args.dtype} on {args.device}, LoRA rank "
        f"{args.lora_rank}, probe {probe_shape} every {args.probe_every}, load {os.getloadavg()[0]:.2f}"
    )
    for transport in args.transports:
        totals = []
        for engine in args.engines:
            r = asyncio.run(
                bench_transport(args.model_dir, transport, args.pushes, probe_shape, mcfg, args.probe_every, engine)
            )
            totals.append(r["total"])
            print(
                f"{transport:14s} {engine:6s} "
                + "  ".join(f"{k} {v * 1000:7.1f} ms" for k, v in r.items())
                + (f"  ({r['total'] / totals[0]:.2f}x {args.engines[0]})" if len(totals) > 1 else "")
                + f"  load {os.getloadavg()[0]:.2f}"
            )
    if args.no_blocks or args.device != "cpu":
        return
    for k, v in building_blocks(args.model_dir, probe_shape).items():
        print(f"  {k:26s} {v * 1000:7.1f} ms")


if __name__ == "__main__":
    main()
