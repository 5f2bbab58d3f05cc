"""A step's statistics over every rank (the metrics row's figures) and its time breakdown into the row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from relayrl.common.episodes import end_name
from relayrl.common.metrics_row import RlRow
from relayrl.common.pb.episode_pb2 import EpisodeEnd
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.ingest import COUNTS, StepBatch
from relayrl.trainer.publication import VersionPublication
from relayrl.trainer.steptime import StepTimes

# EpisodeEnd values by number, as metrics name them (UNSPECIFIED: a single-turn episode)
EPISODE_ENDS = tuple(end_name(v) for v in range(max(EpisodeEnd.values()) + 1))


# what each rank sums over its episodes, in this order: one fixed-size vector, one SUM all-reduce
_TOTALS = (
    "episodes",
    "reward",
    "reward_sq",
    "staleness",
    "completion_tokens",
    "excluded",
    "turns",
    "tool_calls",
    "tool_errors",
    "multi_version",
)


@dataclass(frozen=True)
class StepSummary:
    """A step's statistics over every rank's episodes (the metrics row's figures)."""

    episodes: int
    reward_mean: float
    reward_std: float
    staleness_mean: float
    staleness_max: int
    completion_len_mean: float
    reward_errors: int  # errored episodes of the step's groups, excluded from the loss
    turns_mean: float
    tool_calls_mean: float
    tool_errors: int
    episodes_multi_version: int  # episodes whose tokens came from several weight versions
    staleness_hist: dict[str, int]  # staleness (as a string) -> episodes; max_staleness + 1 counts beyond it
    episode_ends: dict[str, int]  # how episodes ended (relayrl.common.episodes.end_name) -> episodes


def global_summary(coll: Collectives, max_staleness: int, batch: StepBatch) -> StepSummary:
    """Step statistics over every rank's episodes (SUM and MAX all-reduces of fixed-size vectors), summed from
    the batch's columns (relayrl.trainer.ingest.StepBatch)."""
    staleness, counts = batch.staleness, batch.counts
    hist = torch.bincount(staleness.long().clamp(0, max_staleness + 1), minlength=max_staleness + 2)
    end = counts[:, COUNTS.index("episode_end")].long()
    ends = torch.bincount(torch.where((end >= 0) & (end < len(EPISODE_ENDS)), end, 0), minlength=len(EPISODE_ENDS))
    column = {name: counts[:, i].sum() for i, name in enumerate(COUNTS)}
    totals = torch.stack(
        [
            torch.tensor(float(len(batch)), dtype=torch.float64),
            batch.reward.sum(),
            (batch.reward**2).sum(),
            staleness.sum().to(torch.float64),
            batch.completion_len.sum(),
            torch.tensor(float(batch.excluded), dtype=torch.float64),
            column["turns"],
            column["tool_calls"],
            column["tool_errors"],
            column["multi_version"],
        ]
    )
    sums = torch.cat([totals, hist.to(torch.float64), ends.to(torch.float64)])
    coll.all_reduce(sums, dist.ReduceOp.SUM, "step_stats")
    maxima = torch.tensor([float(staleness.max()) if len(staleness) else 0.0], dtype=torch.float64)
    coll.all_reduce(maxima, dist.ReduceOp.MAX, "step_stats_max")
    values = sums.tolist()  # the summary's one host read
    t = dict(zip(_TOTALS, values, strict=False))
    lags, by_end = values[len(_TOTALS) : len(_TOTALS) + len(hist)], values[len(_TOTALS) + len(hist) :]
    n = max(t["episodes"], 1.0)
    mean = t["reward"] / n
    return StepSummary(
        episodes=int(t["episodes"]),
        reward_mean=mean,
        reward_std=max(t["reward_sq"] / n - mean * mean, 0.0) ** 0.5,
        staleness_mean=t["staleness"] / n,
        staleness_max=int(maxima[0]),
        completion_len_mean=t["completion_tokens"] / n,
        reward_errors=int(t["excluded"]),
        turns_mean=t["turns"] / n,
        tool_calls_mean=t["tool_calls"] / n,
        tool_errors=int(t["tool_errors"]),
        episodes_multi_version=int(t["multi_version"]),
        staleness_hist={str(lag): int(c) for lag, c in enumerate(lags) if c},
        episode_ends={EPISODE_ENDS[i]: int(c) for i, c in enumerate(by_end) if c},
    )


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
