"""What `relayrl run` reports about a run: the progress line of each metrics row and summary.json's books."""

from __future__ import annotations

from typing import Any

from relayrl.common import books
from relayrl.common.metrics_row import EvalRow, MetricsRow, RlRow, SftRow, rl_rows, time_shares


def progress_line(row: MetricsRow | None, total: int) -> str | None:
    """The launcher's line for one metrics row (every 10th warm-up step, every training step)."""
    if isinstance(row, SftRow):
        return f"  warm-up {row.sft_step:>4}  loss {row.loss:.3f}" if row.sft_step % 10 == 0 else None
    if isinstance(row, EvalRow):
        return (
            f"  eval after step {row.eval_step:>4}  greedy accuracy {row.greedy_accuracy:.3f}  "
            f"({row.rows} rows, versions {row.weight_version_min}-{row.weight_version_max}, {row.seconds:.0f}s)"
        )
    if isinstance(row, RlRow):
        return (
            f"  step {row.step:>4}/{total}  reward {row.reward_mean:.3f}  "
            f"staleness {row.staleness_mean:.2f} (max {row.staleness_max})  "
            f"episodes/s {row.episodes_per_s:.1f}  {row.time_s:.0f}s"
        )
    return None


def run_summary(
    rows: list[MetricsRow],
    produced: int,
    stream_length: int,
    pending: int,
    durable_step: int,
    invalid: tuple[int, int] = (0, 0),
    foreign: int = 0,
) -> dict[str, Any]:
    """summary.json: the run's books in groups (stream entries), each group counted once:
    produced + foreign = trained + dropped as stale + dropped for reward errors + dropped with zero advantage
    (dynamic sampling) + invalid + pending.

    ``foreign``: entries appended to the stream by something other than rollout (Redis's count of entries ever
    added, less rollout's ``produced``); 0 unless someone else writes to the stream, and then most likely among the
    invalid ones.

    Invalid (``invalid``: groups, episodes, from Redis) counts the entries moved to the dead-letter stream: they
    are acknowledged when moved, whatever the checkpoints, so they are never pending. The stream's length is not
    part of the identity: acknowledged entries are trimmed.

    Trained and dropped count what the last durable checkpoint (step ``durable_step``, 0 for none) holds: only
    those groups are acknowledged. Groups trained or dropped after it are still pending in the stream (a resumed
    run reads them again), so they are counted there, and reported apart as ``groups_after_checkpoint``.

    ``trainer_time``: the shares of the trainer's wall time over the run (relayrl.common.metrics_row.time_shares;
    empty when no row carries a breakdown)."""
    rl = rl_rows(rows)
    durable = next((r for r in reversed(rl) if r.step <= durable_step), RlRow(step=0))
    last = rl[-1] if rl else RlRow(step=0)

    counts = books.values(durable)  # the durable checkpoint's books; invalid entries are acknowledged at once
    counts[books.INVALID.groups], counts[books.INVALID.episodes] = invalid
    return {
        "groups_produced": produced,
        "groups_foreign": foreign,
        "stream_length": stream_length,
        "checkpoint_step": durable.step,
        **counts,
        "groups_pending": pending,
        "groups_after_checkpoint": books.groups_handled(last) - books.groups_handled(durable),
        "trainer_time": time_shares(rl),
    }


def entries_added(client: Any, stream: str, fallback: int) -> int:
    """Entries ever appended to ``stream`` (XINFO STREAM ``entries-added``, Redis >= 7; trimming does not lower it);
    ``fallback`` where the server does not say or the stream does not exist."""
    import redis

    try:
        added = client.xinfo_stream(stream).get("entries-added")
    except redis.exceptions.ResponseError:
        return fallback
    return int(added) if added is not None else fallback
