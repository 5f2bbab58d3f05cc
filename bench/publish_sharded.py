"""Rank 0's memory during the publication of an FSDP2-sharded model: streamed (this project) vs keep-everything.

Two gloo ranks shard a randomly initialised Llama (``--vocab/--hidden/--intermediate/--layers``; the defaults make
about 300 MB of float32) with the trainer's ``apply_fsdp``. Rank 0 then runs the trainer side of one publication:

- ``streamed``: ``WeightPublisher.gather`` (every full tensor written into the transport's spool file and hashed as
  it arrives, then dropped), ``snapshot``, ``transport.prepare``, every message of the stream built as gRPC would
  send it (then dropped), and the probe scored on the file's tensors (``expected_probe``, through a memory map);
- ``baseline``: the code this replaced, the same steps with every full tensor kept on the CPU (a dict of all of
  them) and handed to the transport as a snapshot in memory (grpc_stream: the whole list of chunks built first).

Inference and the network are left out: what is measured is what rank 0 holds. Each (mode, transport) runs in a
fresh pair of processes. A sampling thread reads rank 0's ``/proc/self/status`` every millisecond: the peak of
``RssAnon`` (the process's own memory) and of ``RssFile`` (file pages mapped into it: the page cache, shared with
inference, reclaimable) above their level just before the publication. The largest number of full-tensor bytes
alive at once is counted at ``DTensor.full_tensor`` by storage (as in tests/unit/trainer/test_streamed_publication.py).
Usage:

    python bench/publish_sharded.py [--transports shared_memory grpc_stream] [--layers 6] [--hidden 1024]
        [--intermediate 2816] [--vocab 16000]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import tempfile
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 1 << 20


class RssPeak:
    """Peak RssAnon / RssFile (bytes) of this process while running, sampled every millisecond."""

    def __init__(self) -> None:
        self.base = self.read()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, value in self.read().items():
                self.peak[key] = max(self.peak[key], value)
            time.sleep(0.001)

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for key, value in self.read().items():
            self.peak[key] = max(self.peak[key], value)


def count_full_tensors() -> dict[str, int]:
    """Wrap DTensor.full_tensor: full-tensor bytes alive now and at most (by storage)."""
    from torch.distributed.tensor import DTensor

    state = {"alive": 0, "peak": 0}
    original = DTensor.full_tensor

    def freed(nbytes: int) -> None:
        state["alive"] -= nbytes

    def full_tensor(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        full: torch.Tensor = original(self, *args, **kwargs)
        storage = full.untyped_storage()
        state["alive"] += storage.nbytes()
        state["peak"] = max(state["peak"], state["alive"])
        weakref.finalize(storage, freed, storage.nbytes())
        return full

    DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
    return state


def baseline_gather(model: Any) -> dict[str, torch.Tensor]:
    """The replaced code: every full tensor kept on the CPU, in named_parameters order."""
    gathered = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            gathered[name] = p.full_tensor().detach().cpu()
    return gathered


def _model(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights on both ranks
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def _rank_main(rank: int, port: int, mode: str, transport: str, out: str, args: argparse.Namespace) -> None:
    from relayrl.common.probe import probe_sequences
    from relayrl.config.publication import WeightTransport
    from relayrl.trainer.parallel_dims import ParallelDims, apply_fsdp
    from relayrl.trainer.transports import make_transport
    from relayrl.trainer.weight_sync import WeightPublisher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
    try:
        model = apply_fsdp(_model(args), ParallelDims(1, 2, 1, 1, 2).build_mesh("cpu"))
        plain = _model(args).eval() if rank == 0 else None  # the trainer's unsharded copy for the probe
        probe = probe_sequences(args.vocab, 4, 32, seed=0)
        weights_dir = Path(out) / f"weights-{mode}-{transport}"
        pub = WeightPublisher(
            model,
            torch.device("cpu"),
            "unused:0",
            make_transport(WeightTransport(transport), 2 * MIB, weights_dir),
            60.0,
            probe,
            None,
            plain_model=plain,
        )
        counter = count_full_tensors()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what loading freed goes back: the level before is the model's
        dist.barrier()
        t: dict[str, float] = {}
        with RssPeak() as rss:
            t0 = time.perf_counter()
            if mode == "streamed":
                pub.gather(keep=rank == 0)
                params: Any = pub.snapshot() if rank == 0 else None
            else:
                params = baseline_gather(model)
            t["gather_s"] = time.perf_counter() - t0
            if rank == 0:
                messages = pub.transport.prepare(params, 1, probe)
                t["prepare_s"] = time.perf_counter() - t0 - t["gather_s"]
                sent = sum(m.ByteSize() for m in messages)  # each message built (and dropped) as gRPC sends it
                del messages
                t1 = time.perf_counter()
                pub.expected_probe(params)
                t["probe_s"] = time.perf_counter() - t1
                t["total_s"] = time.perf_counter() - t0
            del params
        if rank == 0:
            total = sum(p.numel() * p.element_size() for p in model.parameters())
            largest = max(p.numel() * p.element_size() for p in model.parameters())
            result = {
                "mode": mode,
                "transport": transport,
                "model_bytes": total,
                "largest_bytes": largest,
                "sent_bytes": sent,
                "peak_full_bytes": counter["peak"],
                "rss_anon_before": rss.base["RssAnon"],
                "rss_file_before": rss.base["RssFile"],
                "peak_anon_above": rss.peak["RssAnon"] - rss.base["RssAnon"],
                "peak_file_above": rss.peak["RssFile"] - rss.base["RssFile"],
                **t,
            }
            (Path(out) / f"{mode}-{transport}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transports", nargs="+", default=["shared_memory", "grpc_stream"])
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        rows = []
        for transport in args.transports:
            for mode in ("baseline", "streamed"):
                mp.start_processes(
                    _rank_main,
                    args=(free_port(), mode, transport, out, args),
                    nprocs=2,
                    start_method="spawn",
                    join=True,
                )
                rows.append(json.loads((Path(out) / f"{mode}-{transport}.json").read_text()))
    first = rows[0]
    print(
        f"model {first['model_bytes'] / MIB:.0f} MiB float32, largest tensor {first['largest_bytes'] / MIB:.1f} "
        f"MiB; load average {Path('/proc/loadavg').read_text().split()[0]}"
    )
    print(
        f"{'transport':14} {'mode':9} {'full MiB':>9} {'anon MiB':>9} {'file MiB':>9} {'gather s':>9} "
        f"{'prepare s':>9} {'probe s':>8} {'total s':>8}"
    )
    for r in rows:
        print(
            f"{r['transport']:14} {r['mode']:9} {r['peak_full_bytes'] / MIB:9.1f} {r['peak_anon_above'] / MIB:9.1f} "
            f"{r['peak_file_above'] / MIB:9.1f} {r['gather_s']:9.2f} {r['prepare_s']:9.2f} {r['probe_s']:8.2f} "
            f"{r['total_s']:8.2f}"
        )
    for transport in args.transports:
        base, new = (
            next(r for r in rows if r["transport"] == transport and r["mode"] == m) for m in ("baseline", "streamed")
        )
        full = new["peak_full_bytes"] / base["peak_full_bytes"]
        anon = new["peak_anon_above"] / max(base["peak_anon_above"], 1)
        print(
            f"{transport}: streamed/baseline peak full-tensor bytes {full:.3f}, peak RssAnon above the model "
            f"{anon:.3f}, "
            f"total time {new['total_s'] / base['total_s']:.2f}"
        )


if __name__ == "__main__":
    main()
