"""A step's statistics over every rank (the metrics row's figures) and its time breakdown into the row."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from relayrl.common.episodes import end_name
from relayrl.common.metrics_row import RlRow
from relayrl.common.pb.episode_pb2 import Episode, EpisodeEnd
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.publication import VersionPublication
from relayrl.trainer.steptime import StepTimes

# EpisodeEnd values by number, as metrics name them (UNSPECIFIED: a single-turn episode)
EPISODE_ENDS = tuple(end_name(v) for v in range(max(EpisodeEnd.values()) + 1))


def global_summary(coll: Collectives, max_staleness: int, episodes: list[Episode], staleness: torch.Tensor,
                   excluded: int = 0) -> dict[str, Any]:
    """Step statistics over every rank's episodes (SUM and MAX all-reduces of fixed-size vectors)."""
    s = max_staleness
    hist = torch.bincount(staleness.long().clamp(0, s + 1), minlength=s + 2).to(torch.float64)
    ends = [0.0] * len(EPISODE_ENDS)  # how episodes ended, by EpisodeEnd value
    # [episodes, reward sum, reward square sum, staleness sum, completion tokens, excluded, turns, tool calls,
    # tool errors, episodes of several versions]: one pass over the episodes (each field read once)
    totals = [float(len(episodes)), 0.0, 0.0, float(staleness.sum()), 0.0, float(excluded), 0.0, 0.0, 0.0, 0.0]
    for ep in episodes:
        end, reward = ep.episode_end, ep.reward
        ends[end if 0 <= end < len(EPISODE_ENDS) else 0] += 1
        totals[1] += reward
        totals[2] += reward * reward
        totals[4] += len(ep.completion_token_ids)
        totals[6] += max(ep.turns, 1)
        totals[7] += ep.tool_calls
        totals[8] += ep.tool_errors
        totals[9] += len(set(ep.token_weight_versions)) > 1
    sums = torch.cat([torch.tensor(totals, dtype=torch.float64), hist, torch.tensor(ends, dtype=torch.float64)])
    coll.all_reduce(sums, dist.ReduceOp.SUM, "step_stats")
    maxima = torch.tensor([float(staleness.max()) if len(staleness) else 0.0], dtype=torch.float64)
    coll.all_reduce(maxima, dist.ReduceOp.MAX, "step_stats_max")
    n = max(float(sums[0]), 1.0)
    mean = float(sums[1]) / n
    k = 10 + s + 2  # where the ends' counts start
    return {"episodes": int(sums[0]), "reward_mean": mean,
            "reward_std": max(float(sums[2]) / n - mean * mean, 0.0) ** 0.5,
            "staleness_mean": float(sums[3]) / n, "staleness_max": int(maxima[0]),
            "completion_len_mean": float(sums[4]) / n, "reward_errors": int(sums[5]),
            "turns_mean": float(sums[6]) / n, "tool_calls_mean": float(sums[7]) / n, "tool_errors": int(sums[8]),
            "episodes_multi_version": int(sums[9]),
            "staleness_hist": {str(lag): int(c) for lag, c in enumerate(sums[10:k].tolist()) if c},
            "episode_ends": {EPISODE_ENDS[i]: int(c) for i, c in enumerate(sums[k:].tolist()) if c}}


def set_times(row: RlRow, times: StepTimes, publication: VersionPublication) -> None:
    """The step's time breakdown into ``row``; the publication's own parts from this step's push."""
    t = times.parts
    row.time_wall_s, row.time_other_s = times.wall, times.other
    row.time_data_s, row.time_fwd_bwd_s, row.time_optimizer_s = t["data"], t["fwd_bwd"], t["optimizer"]
    row.time_publish_s, row.time_checkpoint_s, row.time_metrics_s = t["publish"], t["checkpoint"], t["metrics"]
    push = publication.last_push
    if push is not None and t["publish"] > 0:
        pt = push.timings
        row.time_publish_serialise_s, row.time_publish_transfer_s = pt.serialise_s, pt.transfer_s
        row.time_publish_swap_s, row.time_publish_probe_s = pt.swap_s, pt.probe_s
