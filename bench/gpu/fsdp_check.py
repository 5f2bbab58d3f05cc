"""FSDP2 as the trainer runs it, on CUDA over NCCL (``--device cuda``, the default) or on the CPU over gloo
(``--device cpu``, where this script is tested): ``--world`` ranks (on CUDA each on GPU ``rank % device_count``) shard a
model with the trainer's ``apply_fsdp``, compute one step's gradients with the project's ``Learner`` on their share of
a batch, and rank 0 compares them with the gradients of one process holding the whole model and batch (on GPU 0).
Then an optimizer step is timed. Prints one JSON line; exit 0 when the gradients agree, 1 when they do not, 2 when
the library refuses the layout (more ranks than GPUs: NCCL does not allow two ranks on one GPU), with its message;
3 when there is no CUDA device.

    python bench/gpu/fsdp_check.py --world 1
    python bench/gpu/fsdp_check.py --world 2 [--device cuda|cpu] [--model-dir DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.synthetic: the batch the gloo FSDP tests use


def _learner(model: Any, coll: Any, device: torch.device) -> Any:
    from relayrl.config.trainer import OptimizerConfig, TrainerConfig
    from relayrl.trainer.learner import Learner

    cfg = TrainerConfig(micro_batch_size=4, optimizer=OptimizerConfig(grad_clip=0.0))
    return Learner(model, cfg, 0, device, 8, coll)  # coll None: one process, no collectives


def _gradients(learner: Any, episodes: list[Any]) -> dict[str, torch.Tensor]:
    from relayrl.trainer.ingest import StepBatch

    learner.rl_gradients(StepBatch.of(episodes))
    out = {}
    for name, p in learner.model.named_parameters():
        if p.grad is not None:
            full = getattr(p.grad, "full_tensor", None)
            out[name] = (full() if full is not None else p.grad).detach().float().cpu()
    return out


def _rank(rank: int, world: int, port: int, model_dir: str, out: str, device_type: str) -> None:
    import torch.distributed as dist

    from relayrl.common.model import load_model
    from relayrl.config.model import ModelConfig
    from relayrl.trainer.collectives import Collectives
    from relayrl.trainer.parallel_dims import ParallelDims, apply_fsdp
    from tests.synthetic import varied_episodes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    result: dict[str, Any] = {"rank": rank}
    try:
        cuda = device_type == "cuda"
        device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        # as the trainer: CPU tensors (step statistics) over gloo, CUDA tensors over NCCL
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
        coll = Collectives(dist.group.WORLD, timeout_s=120)
        mesh = ParallelDims(1, world, 1, 1, world).build_mesh(device_type)
        model = apply_fsdp(load_model(ModelConfig(path=Path(model_dir), device=str(device))), mesh)
        learner = _learner(model, coll, device)
        episodes = varied_episodes()
        share = episodes[rank * len(episodes) // world : (rank + 1) * len(episodes) // world]
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        grads = _gradients(learner, share)
        sync()
        result["gradients_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        learner._optimizer_step()
        sync()
        result["optimizer_step_s"] = time.perf_counter() - t0
        if rank == 0:
            torch.save(grads, Path(out) / "grads.pt")
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # reported, not raised: the parent tells a refusal of the layout from a wrong result
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-2000:]
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=1, help="ranks (processes); more ranks than GPUs share GPUs")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: NCCL; cpu: gloo")
    ap.add_argument("--model-dir", type=Path, help="default: the demo model, created in a temporary folder")
    ap.add_argument("--out", type=Path, help="keep the per-rank results here")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    from relayrl.common.model import load_model
    from relayrl.config.model import ModelConfig
    from relayrl.tasks.tiny_model import create_tiny_model
    from tests.synthetic import varied_episodes

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print(json.dumps({"world": args.world, "error": "no CUDA device"}))
        return 3
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 on both sides: compare like with like
    torch.backends.cudnn.allow_tf32 = False
    ref_device = torch.device("cuda:0" if cuda else "cpu")
    tmp = tempfile.TemporaryDirectory()
    out = args.out or Path(tmp.name) / "out"
    out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or create_tiny_model(Path(tmp.name) / "model")
    reference = _gradients(
        _learner(load_model(ModelConfig(path=model_dir, device=str(ref_device))), None, ref_device), varied_episodes()
    )
    mp.start_processes(
        _rank,
        args=(args.world, _free_port(), str(model_dir), str(out), args.device),
        nprocs=args.world,
        start_method="spawn",
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.world)]
    report: dict[str, Any] = {
        "world": args.world,
        "device": args.device,
        "gpus": torch.cuda.device_count(),
        "ranks": ranks,
    }
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        # more ranks than GPUs on NCCL: the library's refusal of the layout (exit 2), not a wrong result; any other
        # error is a failure (exit 1)
        shared_gpu = cuda and args.world > torch.cuda.device_count()
        report["refused" if shared_gpu else "error"] = errors[0]
        print(json.dumps(report))
        return 2 if shared_gpu else 1
    got = torch.load(out / "grads.pt")
    # float32 sums of the same per-token terms split over ranks and reduce-scattered: summation order only
    worst = max(float(((got[n] - g).abs() / (g.abs() + 1e-6)).max()) for n, g in reference.items() if n in got)
    agree = set(got) == set(reference) and all(
        torch.allclose(got[n], g, rtol=1e-4, atol=1e-6) for n, g in reference.items()
    )
    report.update(agree=agree, max_relative_difference=worst)
    print(json.dumps(report))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
