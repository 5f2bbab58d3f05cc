"""The run summary `relayrl run` writes and prints once the services stopped."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from relayrl.common.checkpoints import checkpoint_step, latest_checkpoint
from relayrl.common.metrics_row import format_books, format_time_shares, read_rows
from relayrl.common.redis_conn import sync_client
from relayrl.common.redis_keys import PROGRESS_APPENDED, RedisKeys
from relayrl.config import RunConfig
from relayrl.run_report import entries_added, run_summary

log = logging.getLogger(__name__)


def write_summary(
    cfg: RunConfig, out: Path, redis_password: str, say: Callable[[str], None], restarts: dict[str, int]
) -> None:
    """After the services stopped: the accounting identity (relayrl.run_report.run_summary) and the children
    started again after they died (``restarts``: inference replicas), written to summary.json and printed."""
    import redis

    keys = RedisKeys.from_config(cfg.redis, cfg.name)
    try:
        client = sync_client(cfg.redis, socket_timeout=5.0, **({"password": redis_password} if redis_password else {}))
        length = int(client.xlen(keys.stream))
        groups = (
            {
                g["name"].decode() if isinstance(g["name"], bytes) else g["name"]: g
                for g in client.xinfo_groups(keys.stream)
            }
            if length
            else {}
        )
        appended = int(client.hget(keys.rollout_progress, PROGRESS_APPENDED) or 0)
        invalid = [int(v) for v in client.hvals(keys.invalid)]  # type: ignore[union-attr]
        added = entries_added(client, keys.stream, appended)
        client.close()
    except redis.exceptions.RedisError as exc:
        log.warning("could not read the stream for the run summary: %s", exc)
        return
    group = groups.get(keys.group, {})
    rows = read_rows(cfg.metrics_path) if cfg.metrics_path.exists() else []
    pending = int(group.get("pending", 0)) + int(group.get("lag", length) or 0)
    latest = latest_checkpoint(out / "checkpoints")
    summary = run_summary(
        rows,
        appended,
        length,
        pending,
        checkpoint_step(latest) if latest else 0,
        (len(invalid), sum(invalid)),
        added - appended,
    )
    (out / "summary.json").write_text(json.dumps({**summary, "restarts": restarts}, indent=1) + "\n")
    after = summary["groups_after_checkpoint"]
    say(
        f"relayrl: {format_books(summary)}"
        + (
            f" ({after} of them trained or dropped after the last checkpoint: a resumed run reads them again)"
            if after
            else ""
        )
    )
    if restarts:
        say("relayrl: restarted " + ", ".join(f"{name} {n}x" for name, n in sorted(restarts.items())))
    if summary["trainer_time"]:
        say(f"relayrl: {format_time_shares(summary['trainer_time'])}")
