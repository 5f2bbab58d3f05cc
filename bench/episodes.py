"""Rollout's building of a single-turn group's episodes (relayrl.rollout.workflows.single_turn.sample_episode).

From one decoded GenerateResponse and ScoreBatchResponse, as rollout receives them: relayrl copies the group's
shared fields into each episode and extends its repeated fields with the sample's; the baseline, in the same
invocation on the same messages, is the constructor with every field as a keyword (what single_turn did before).
Both make the same bytes (checked before timing). The two alternate within each repeat. Usage:

    python bench/episodes.py [--group-size 16] [--prompt 11] [--completion 2] [--components 0] [--repeats 2000]

Prints the median microseconds per group of each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from relayrl.common.episodes import reward_of
from relayrl.common.pb import episode_pb2, inference_pb2, reward_pb2
from relayrl.rollout.workflows.single_turn import sample_episode

Messages = tuple[inference_pb2.GenerateResponse, reward_pb2.ScoreBatchResponse, list[str]]


def messages(group_size: int, prompt: int, completion: int, components: int) -> Messages:
    """A group's answers from inference and reward, decoded from their wire bytes (as rollout's clients get them)."""
    gen = inference_pb2.GenerateResponse(
        prompt_token_ids=list(range(1, prompt + 1)),
        samples=[
            inference_pb2.Sample(
                token_ids=[3 + i % 7] * completion,
                logprobs=[-0.5] * completion,
                weight_versions=[7] * completion,
                text=f"completion {i}",
                finish_reason=1,
            )
            for i in range(group_size)
        ],
    )
    scores = reward_pb2.ScoreBatchResponse(
        responses=[
            reward_pb2.ScoreResponse(score=float(i % 2), components={f"part{c}": 0.5 for c in range(components)})
            for i in range(group_size)
        ]
    )
    ids = [f"{i:032x}" for i in range(group_size)]
    return (
        inference_pb2.GenerateResponse.FromString(gen.SerializeToString()),
        reward_pb2.ScoreBatchResponse.FromString(scores.SerializeToString()),
        ids,
    )


SHARED = {
    "prompt_id": "p1",
    "group_id": "g1",
    "producer_id": "rollout-0",
    "created_at": 1.0,
    "enqueued_at": 2.0,
    "prompt_text": "3+4=",
    "sampling_temperature": 1.0,
}


def keywords(m: Messages) -> list[episode_pb2.Episode]:
    """The baseline: each episode from every field as a keyword."""
    gen, scores, ids = m
    return [
        episode_pb2.Episode(
            episode_id=eid,
            sample_index=i,
            group_size=len(ids),
            prompt_token_ids=gen.prompt_token_ids,
            completion_token_ids=s.token_ids,
            behaviour_logprobs=s.logprobs,
            token_weight_versions=s.weight_versions,
            loss_mask=[1] * len(s.token_ids),
            reward=reward_of(r),
            reward_components=dict(r.components),
            reward_status=r.status,
            reward_error=r.error,
            finish_reason=s.finish_reason,
            completion_text=s.text,
            **SHARED,  # type: ignore[arg-type]
        )
        for i, (eid, s, r) in enumerate(zip(ids, gen.samples, scores.responses, strict=True))
    ]


def copied(m: Messages) -> list[episode_pb2.Episode]:
    """relayrl's: the shared fields set once, copied into each episode with its sample's own."""
    gen, scores, ids = m
    shared = episode_pb2.Episode(group_size=len(ids), prompt_token_ids=gen.prompt_token_ids, **SHARED)  # type: ignore[arg-type]
    return [
        sample_episode(shared, i, eid, s, r)
        for i, (eid, s, r) in enumerate(zip(ids, gen.samples, scores.responses, strict=True))
    ]


def build_us(m: Messages, repeats: int) -> dict[str, float]:
    if [e.SerializeToString() for e in keywords(m)] != [e.SerializeToString() for e in copied(m)]:
        raise SystemExit("the two ways must build the same episodes")
    times: dict[str, list[float]] = {"keywords": [], "copied": []}
    for _ in range(repeats):
        for name, build in (("keywords", keywords), ("copied", copied)):
            t0 = time.perf_counter()
            build(m)
            times[name].append(time.perf_counter() - t0)
    return {k: 1e6 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=11, help="prompt tokens")
    ap.add_argument("--completion", type=int, default=2, help="completion tokens per episode")
    ap.add_argument("--components", type=int, default=0, help="reward components per score")
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args()
    us = build_us(messages(args.group_size, args.prompt, args.completion, args.components), args.repeats)
    print(
        f"building a group of {args.group_size} single-turn episodes ({args.components} reward components): "
        f"baseline (every field a keyword) {us['keywords']:.1f} us; relayrl (shared fields copied) "
        f"{us['copied']:.1f} us; ratio {us['keywords'] / us['copied']:.2f}x"
    )


if __name__ == "__main__":
    main()
