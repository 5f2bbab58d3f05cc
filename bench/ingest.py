"""The trainer's ingest of one step's groups (relayrl.trainer.ingest): each group as it arrives, then the take.

Per group on arrival: decoding, ``Ingested.of``, validation and gathering its valid episodes' columns; then, once
the last group is in, ``StepBatch.take`` lays out the whole batch as arrays that its tensors share. The baseline,
in the same invocation on the same entries, is the layout this replaced: each group's training positions built as
Python lists on arrival, the take joining them and making each column a tensor from a list (``torch.tensor``). The
two alternate within each repeat, so that both see the same machine. Usage:

    python bench/ingest.py [--groups 8] [--group-size 16] [--prompt 11] [--completion 2] [--repeats 300]

Prints the median milliseconds of the arrivals and of the take for each, and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from relayrl.common.episodes import Limits, TokenLists, validate_group
from relayrl.common.pb import reward_pb2
from relayrl.common.pb.episode_pb2 import Episode, EpisodeGroup
from relayrl.common.redis_keys import STREAM_FIELD
from relayrl.common.stream import StreamEntry
from relayrl.trainer.ingest import Columns, Ingested, StepBatch


def groups(n: int, size: int, prompt: int, completion: int) -> list[StreamEntry]:
    def episode(gid: str, i: int) -> Episode:
        return Episode(
            episode_id=f"{gid}-{i}",
            group_id=gid,
            sample_index=i,
            group_size=size,
            prompt_token_ids=list(range(1, prompt + 1)),
            completion_token_ids=[3] * completion,
            behaviour_logprobs=[-0.5] * completion,
            token_weight_versions=[7] * completion,
            loss_mask=[1] * completion,
            reward=float(i % 2),
            reward_status=reward_pb2.SCORE_STATUS_OK,
        )

    return [
        StreamEntry(f"0-{g}", group, {STREAM_FIELD: group.SerializeToString()})
        for g, group in enumerate(
            EpisodeGroup(group_id=f"g{g}", episodes=[episode(f"g{g}", i) for i in range(size)]) for g in range(n)
        )
    ]


def list_positions(lists: list[TokenLists], temperatures: list[float]) -> dict[str, list[Any]]:
    """The baseline's layout of one group on arrival: training positions as Python lists, one sequence at a time."""
    out: dict[str, list[Any]] = {k: [] for k in ("ids", "targets", "mask", "behaviour", "completion_at", "lengths")}
    for t in lists:
        full, lead = [*t.prompt, *t.completion], len(t.prompt) - 1
        out["ids"] += full[:-1]
        out["targets"] += full[1:]
        out["lengths"].append(lead + len(t.completion))
        out["mask"] += [0.0] * lead + [float(m) for m in t.loss_mask]
        out["behaviour"] += [0.0] * lead + t.behaviour
        out["completion_at"] += [-1] * lead + list(range(len(t.completion)))
    out["temperature"] = temperatures
    return out


def list_take(parts: list[tuple[Columns, dict[str, list[Any]]]], lags: dict[int, int]) -> list[torch.Tensor]:
    """The baseline's take: the groups' lists joined, each column made a tensor from its list."""
    joined = {k: [v for _, lay in parts for v in lay[k]] for k in parts[0][1]}
    columns = [c for c, _ in parts]
    long, f32, f64 = torch.long, torch.float32, torch.float64
    return [
        *(torch.tensor(joined[k], dtype=long) for k in ("ids", "targets", "completion_at", "lengths")),
        *(torch.tensor(joined[k], dtype=f32) for k in ("mask", "behaviour", "temperature")),
        torch.tensor([v for c in columns for v in c.reward], dtype=f64),
        torch.tensor([g for g, c in enumerate(columns) for _ in c.episodes], dtype=long),
        torch.tensor([len(t.completion) for c in columns for t in c.lists], dtype=f64),
        torch.tensor([lags[v] for c in columns for v in c.oldest], dtype=f32),
        torch.tensor([v for c in columns for v in c.oldest], dtype=long),
        torch.tensor([v for c in columns for v in c.newest], dtype=long),
        torch.tensor([v for c in columns for v in c.counts], dtype=f64),
    ]


def arrive(entry: StreamEntry, limits: Limits) -> Ingested:
    group = EpisodeGroup.FromString(entry.fields[STREAM_FIELD])
    ingested = Ingested.of(StreamEntry(entry.entry_id, group, entry.fields))
    if validate_group(group, limits, ingested.lists) is not None:
        raise SystemExit("the benchmark's groups must be valid")
    return ingested.valid()


def ingest_ms(entries: list[StreamEntry], repeats: int) -> dict[str, float]:
    """Median milliseconds of the arrivals of ``entries`` and of the take, for the baseline and for relayrl's."""
    limits, lags = Limits(vocab_size=1000, max_completion_tokens=1000, newest_version=7), {7: 0}
    times: dict[str, list[float]] = {k: [] for k in ("base_arrive", "base_take", "arrive", "take")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        laid = [
            (ing.columns, list_positions(ing.columns.lists, ing.columns.temperature))
            for ing in (arrive(e, limits) for e in entries)
            if ing.columns is not None
        ]
        t1 = time.perf_counter()
        list_take(laid, lags)
        t2 = time.perf_counter()
        ready = [arrive(e, limits) for e in entries]
        t3 = time.perf_counter()
        StepBatch.take(ready, lags)
        t4 = time.perf_counter()
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[k].append(dt)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=11, help="prompt tokens per episode")
    ap.add_argument("--completion", type=int, default=2, help="completion tokens per episode")
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    entries = groups(args.groups, args.group_size, args.prompt, args.completion)
    ms = ingest_ms(entries, args.repeats)
    base, new = ms["base_arrive"] + ms["base_take"], ms["arrive"] + ms["take"]
    print(
        f"ingesting {args.groups} x {args.group_size} episodes: baseline (per-group position lists, tensors from "
        f"lists) arrivals {ms['base_arrive']:.3f} + take {ms['base_take']:.3f} = {base:.3f} ms; relayrl arrivals "
        f"{ms['arrive']:.3f} + take {ms['take']:.3f} = {new:.3f} ms; ratio: take {ms['base_take'] / ms['take']:.1f}x, "
        f"all {base / new:.2f}x"
    )


if __name__ == "__main__":
    main()
