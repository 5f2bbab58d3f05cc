"""The run's books are declared once (relayrl.common.books): every counter is a field wherever the books are typed
(the trainer's status, its progress, the metrics row), every drop reason names its record in Redis, and the
summaries' line of outcomes follows the table."""

from __future__ import annotations

import dataclasses

from relayrl.common import books
from relayrl.common.metrics_row import GROUP_OUTCOMES, RlRow
from relayrl.common.pb import trainer_pb2
from relayrl.common.redis_keys import RedisKeys
from relayrl.config.redis import RedisConfig
from relayrl.run_report import run_summary
from relayrl.trainer.progress import TrainerProgress


def test_every_counter_is_a_field_of_the_status_the_progress_and_the_metrics_row() -> None:
    status = set(trainer_pb2.TrainerStatus.DESCRIPTOR.fields_by_name)
    progress = {f.name for f in dataclasses.fields(TrainerProgress)}
    row = {f.name for f in dataclasses.fields(RlRow)}

    for name in books.COUNTER_NAMES:
        assert name in status and name in progress and name in row, name


def test_every_drop_reason_names_its_own_record_in_redis() -> None:
    keys = RedisKeys.from_config(RedisConfig(), "run")
    records = [keys.dropped(reason) for reason in books.DROP_REASONS]

    assert books.DROP_REASONS == ("stale", "reward_error", "zero_advantage")
    assert len(set(records)) == len(records) and all(
        reason in r for reason, r in zip(books.DROP_REASONS, records, strict=True)
    )


def test_the_books_line_lists_every_outcome_then_pending() -> None:
    assert [key for key, _ in GROUP_OUTCOMES] == [*(o.groups for o in books.OUTCOMES), "groups_pending"]


def test_a_summary_counts_every_outcome_and_adds_up() -> None:
    row = RlRow(
        step=3,
        groups_trained=12,
        groups_dropped_stale=2,
        groups_dropped_reward_error=1,
        groups_dropped_zero_advantage=3,
        episodes_trained=96,
    )

    summary = run_summary([row], produced=25, stream_length=5, pending=5, durable_step=3, invalid=(2, 16))

    outcomes = sum(summary[o.groups] for o in books.OUTCOMES) + summary["groups_pending"]
    assert summary["groups_produced"] == outcomes == 25
    assert summary["episodes_invalid"] == 16 and summary["groups_after_checkpoint"] == 0
    assert books.groups_left(trainer_pb2.TrainerStatus(groups_dropped_stale=2, groups_invalid=1)) == 3
