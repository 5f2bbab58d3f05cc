"""The tail of a step's read: taking the batch once its last group has arrived (relayrl.trainer.ingest).

The collector lays each valid group out as columns when it arrives (``Ingested.valid``), while it waits for the
step's other groups; taking the batch then only joins them (``StepBatch.take``). The baseline, in the same
invocation on the same groups, builds every column at the take, as the trainer did before. Both sides start from
the same decoded, validated groups; what is timed is the take alone, the part that stands between the last group's
arrival and the step. Usage:

    python bench/ingest.py [--groups 8] [--group-size 16] [--prompt 11] [--completion 2] [--repeats 300]

Prints the median time of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from relayrl.common.pb import reward_pb2
from relayrl.common.pb.episode_pb2 import Episode, EpisodeGroup
from relayrl.common.stream import StreamEntry
from relayrl.trainer.ingest import Ingested, StepBatch


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
        StreamEntry(f"0-{g}", EpisodeGroup(group_id=f"g{g}", episodes=[episode(f"g{g}", i) for i in range(size)]))
        for g in range(n)
    ]


def take_ms(entries: list[StreamEntry], repeats: int) -> tuple[float, float]:
    """Median milliseconds of ``StepBatch.take`` over ``entries``: their columns built at the take (baseline), and
    laid out beforehand; the two alternate within each repeat, so that both see the same machine."""
    at_take, laid_out = [], []
    for _ in range(repeats):
        raw = [Ingested.of(e) for e in entries]
        ready = [ing.valid() for ing in (Ingested.of(e) for e in entries)]
        t0 = time.perf_counter()
        StepBatch.take(raw, {7: 0})
        t1 = time.perf_counter()
        StepBatch.take(ready, {7: 0})
        t2 = time.perf_counter()
        at_take.append(t1 - t0)
        laid_out.append(t2 - t1)
    return 1000 * statistics.median(at_take), 1000 * statistics.median(laid_out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=11, help="prompt tokens per episode")
    ap.add_argument("--completion", type=int, default=2, help="completion tokens per episode")
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    entries = groups(args.groups, args.group_size, args.prompt, args.completion)
    baseline, joined = take_ms(entries, args.repeats)
    print(
        f"taking a batch of {args.groups} x {args.group_size} episodes: columns built at the take {baseline:.3f} ms "
        f"(baseline), laid out per group on arrival {joined:.3f} ms; ratio {baseline / joined:.1f}x"
    )


if __name__ == "__main__":
    main()
