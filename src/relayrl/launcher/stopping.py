"""How the launcher stops the stack: in which order, and how long each service may take to stop gracefully."""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.common.metrics_row import MetricsRow, rl_rows
from relayrl.config.trainer import STOP_MARGIN, graceful_stop_s

# shutdown in two stages: the trainer (its final checkpoint may settle a push to inference and acknowledges in
# Redis) and rollout first, then the servers they use; Redis last
STOP_STAGES = (("rollout", "trainer"), ("inference", "reward"))
SERVICE_STOP_S = 15.0  # the deadline of a service other than the trainer (their gRPC grace is 5 s)


def stop_deadline(rows: Sequence[MetricsRow], grace_s: float, max_s: float) -> tuple[float, str]:
    """How long to wait for the trainer to stop gracefully, and why: :func:`graceful_stop_s` of the longest
    step, push and checkpoint measured in ``rows``."""
    steps = rl_rows(rows)
    step = max((r.step_time_s for r in steps), default=0.0)
    push = max((r.weight_sync_s or 0.0 for r in steps), default=0.0)
    checkpoint = max((r.time_checkpoint_s for r in steps), default=0.0)
    budget = graceful_stop_s(step, push, checkpoint, grace_s, max_s)
    measured = (
        f"{STOP_MARGIN:g} x (longest step {step:.1f}s + push {push:.1f}s + checkpoint {checkpoint:.1f}s) = "
        f"{budget.need_s:.1f}s over {len(steps)} steps in metrics.jsonl"
        if steps
        else "no step measured yet"
    )
    return budget.deadline_s, (
        f"{measured}; trainer.stop_grace_s {grace_s:g}s, trainer.stop_grace_max_s {max_s:g}s: {budget.bound}"
    )
