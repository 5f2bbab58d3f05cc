"""The launcher's stop deadline for the trainer: it follows the measured steps, pushes and checkpoints
(metrics.jsonl) and trainer.stop_grace_s, bounded by trainer.stop_grace_max_s, and says which bound it used."""

from __future__ import annotations

import pytest

from relayrl.common.metrics_row import RlRow, SftRow
from relayrl.config import load_run_config
from relayrl.config.typed import ConfigError
from relayrl.launcher import STOP_MARGIN, stop_deadline


def _row(step: int, step_s: float, push_s: float | None = None, checkpoint_s: float = 0.0) -> RlRow:
    return RlRow(step=step, step_time_s=step_s, weight_sync_s=push_s, time_checkpoint_s=checkpoint_s)


def test_with_no_step_measured_the_deadline_is_the_configured_grace() -> None:
    deadline, why = stop_deadline([SftRow(sft_step=1, loss=0.0, grad_norm=0.0, time_s=1.0)], 30.0, 600.0)

    assert deadline == 30.0
    assert "no step measured yet" in why and why.endswith("trainer.stop_grace_s")


def test_long_steps_lengthen_the_deadline_past_the_grace_by_the_longest_step_push_and_checkpoint() -> None:
    rows = [_row(1, 18.0, 0.5), _row(2, 20.0, 0.4, checkpoint_s=6.0), _row(3, 19.0, 1.0)]

    deadline, why = stop_deadline(rows, 15.0, 600.0)

    assert deadline == pytest.approx(STOP_MARGIN * (20.0 + 1.0 + 6.0))
    assert "longest step 20.0s + push 1.0s + checkpoint 6.0s" in why and "over 3 steps" in why
    assert why.endswith("the measured steps")


def test_short_steps_keep_the_configured_grace() -> None:
    deadline, why = stop_deadline([_row(1, 0.2, 0.01)], 30.0, 600.0)

    assert deadline == 30.0 and why.endswith("trainer.stop_grace_s")


def test_the_deadline_is_bounded_by_stop_grace_max_s() -> None:
    deadline, why = stop_deadline([_row(1, 900.0)], 30.0, 120.0)

    assert deadline == 120.0 and why.endswith("trainer.stop_grace_max_s")


def test_a_maximum_below_the_grace_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="stop_grace_max_s"):
        load_run_config(None, ["trainer.stop_grace_s=60", "trainer.stop_grace_max_s=30"])
