"""The trainer's per-rank logic that needs no communication, under torch's fake process group.

The fake backend runs every collective in one process as a no-op (each rank sees its own tensors back), so these
tests check what each rank decides and which collectives it issues, in which order, for ranks with different
data. Collectives that must move data between ranks are tested over real gloo ranks in tests/distributed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from relayrl.common.model import load_model
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import TrainerConfig
from relayrl.trainer import learner as learner_module
from relayrl.trainer.batching import plan_micro_batches
from relayrl.trainer.collective_debug import find_divergence, load_records
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.groups import consumer_name, groups_per_rank, live_consumers
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner, StepAbandoned, agreed_micro_batches
from relayrl.trainer.publication import VersionPublication
from relayrl.trainer.step_summary import global_summary

WORLD = 2


@contextmanager
def fake_rank(rank: int, world_size: int = WORLD, record_dir: Path | None = None) -> Iterator[Collectives]:
    """``Collectives`` of one rank of a fake process group (destroyed afterwards)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        group = dist.group.WORLD
        assert group is not None
        coll = Collectives(group, timeout_s=10, record_dir=record_dir, group_name="world")
        yield coll
        coll.close()
    finally:
        dist.destroy_process_group()


def test_each_rank_reads_its_share_as_its_own_stable_consumer() -> None:
    assert [groups_per_rank(8, w) for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert [consumer_name("trainer", r) for r in range(WORLD)] == ["trainer-rank0", "trainer-rank1"]
    # rank 0 claims the pending entries of consumers outside this set (a larger earlier world size)
    assert live_consumers("trainer", 2) == {"trainer-rank0", "trainer-rank1"}
    assert "trainer-rank2" not in live_consumers("trainer", 2)


@pytest.mark.parametrize("rank", range(WORLD))
def test_rank_and_world_size_come_from_the_group(rank: int) -> None:
    with fake_rank(rank) as coll:
        assert (coll.rank, coll.world_size) == (rank, WORLD)


@pytest.mark.parametrize(("episodes", "micro", "local"), [(6, 2, 3), (6, 5, 2), (0, 4, 0), (1, 64, 1)])
def test_micro_batch_count_is_agreed_by_one_max_all_reduce(
    tmp_path: Path, episodes: int, micro: int, local: int
) -> None:
    with fake_rank(1, record_dir=tmp_path) as coll:
        n = agreed_micro_batches(coll, episodes, micro)

    assert n == local  # the fake all-reduce returns this rank's own count: its part of the MAX
    [call] = load_records(tmp_path)[1]
    assert (call.op, call.name, call.reduce_op, call.shapes) == ("all_reduce", "micro_batch_count", "MAX", ((1,),))


def _episodes(n: int, seed: int) -> list[Episode]:
    g = torch.Generator().manual_seed(seed)
    eps = []
    for i in range(n):
        n_c = 1 + (i * 5 + seed) % 7
        eps.append(
            Episode(
                episode_id=f"{seed}-{i}",
                group_id=f"g{seed}-{i // 3}",
                group_size=3,
                prompt_token_ids=torch.randint(3, 17, (2 + i % 3,), generator=g).tolist(),
                completion_token_ids=torch.randint(3, 18, (n_c,), generator=g).tolist(),
                behaviour_logprobs=(-torch.rand(n_c, generator=g) * 3).tolist(),
                token_weight_versions=[1] * n_c,
                loss_mask=[1] * n_c,
                reward=float(torch.rand(1, generator=g)),
                sampling_temperature=1.0,
            )
        )
    return eps


def _max_of(monkeypatch: pytest.MonkeyPatch, counts: list[int]) -> None:
    """The agreed micro-batch count that a real MAX all-reduce gives every rank (the fake one returns the rank's own):
    the collective is still issued and recorded."""
    real = learner_module.agreed_count

    def agreed(coll: Collectives, local: int) -> int:
        real(coll, local)
        return max(counts)

    monkeypatch.setattr(learner_module, "agreed_count", agreed)


def test_ranks_with_different_shares_and_micro_batches_issue_the_same_collectives(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The invariant that keeps real ranks from hanging: whatever a rank's data, the same collective sequence."""
    shares = {0: (_episodes(6, 0), 2), 1: (_episodes(3, 1), 5)}  # 3 vs 1 local micro-batches, other token counts
    _max_of(monkeypatch, [3, 1])
    for rank, (episodes, micro) in shares.items():
        model = load_model(ModelConfig(path=tiny_model_dir))
        with fake_rank(rank, record_dir=tmp_path) as coll:
            Learner(
                model,
                TrainerConfig(micro_batch_size=micro),
                0,
                torch.device("cpu"),
                max_completion_tokens=8,
                collectives=coll,
            ).rl_step(StepBatch.of(episodes))
            global_summary(coll, 1, StepBatch.of(episodes))

    records = load_records(tmp_path)
    assert find_divergence(records) is None
    assert [c.name for c in records[0]] == [
        "global_tokens_and_episodes",
        "micro_batch_count",
        *["stop_requested"] * 3,  # one agreement before each micro-batch
        "gradients",
        "loss_stats",
        "importance_max",
        "step_stats",
        "step_stats_max",
    ]


def test_ranks_splitting_by_token_budget_into_different_counts_issue_the_same_collectives(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With micro-batches by tokens the count depends on each rank's lengths: agreed by the MAX all-reduce."""
    shares = {0: (_episodes(6, 0), 8), 1: (_episodes(3, 1), 64)}
    local: dict[int, int] = {}
    for rank, (episodes, budget) in shares.items():
        lengths = [len(e.prompt_token_ids) + len(e.completion_token_ids) - 1 for e in episodes]
        local[rank] = len(plan_micro_batches(lengths, 64, budget))
    _max_of(monkeypatch, list(local.values()))
    for rank, (episodes, budget) in shares.items():
        model = load_model(ModelConfig(path=tiny_model_dir))
        with fake_rank(rank, record_dir=tmp_path) as coll:
            Learner(
                model,
                TrainerConfig(micro_batch_tokens=budget),
                0,
                torch.device("cpu"),
                max_completion_tokens=8,
                collectives=coll,
            ).rl_step(StepBatch.of(episodes))

    records = load_records(tmp_path)
    assert local[0] > local[1]  # the ranks' own splits differ ...
    assert find_divergence(records) is None  # ... and their collective sequences do not
    assert [c.name for c in records[1]] == [
        "global_tokens_and_episodes",
        "micro_batch_count",
        *["stop_requested"] * local[0],
        "gradients",
        "loss_stats",
        "importance_max",
    ]


def test_a_rank_asked_to_stop_abandons_the_step_at_the_boundary_where_the_ranks_agree(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The stop is agreed by one MAX all-reduce of the flag before each micro-batch (with the fake group a rank
    sees its own flag: a real one gives every rank the MAX); the step's partial gradients go, no optimizer step."""
    model = load_model(ModelConfig(path=tiny_model_dir))
    with fake_rank(1, record_dir=tmp_path) as coll:
        learner = Learner(
            model, TrainerConfig(micro_batch_size=2), 0, torch.device("cpu"), max_completion_tokens=8, collectives=coll
        )
        before = [p.detach().clone() for p in model.parameters()]
        learner.stop.set()
        with pytest.raises(StepAbandoned) as abandoned:
            learner.rl_step(StepBatch.of(_episodes(6, 0)))

    assert (abandoned.value.done, abandoned.value.total) == (0, 3)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert learner.steps_done == 0 and not learner.optimizer.state
    [*_, call] = load_records(tmp_path)[1]
    assert (call.op, call.name, call.reduce_op, call.shapes) == ("all_reduce", "stop_requested", "MAX", ((1,),))


def test_one_rank_checks_its_stop_flag_without_a_collective(tiny_model_dir: Path, tmp_path: Path) -> None:
    coll = Collectives(None, timeout_s=10, record_dir=tmp_path)
    Learner(
        load_model(ModelConfig(path=tiny_model_dir)),
        TrainerConfig(micro_batch_size=2),
        0,
        torch.device("cpu"),
        max_completion_tokens=8,
        collectives=coll,
    ).rl_step(StepBatch.of(_episodes(6, 0)))
    coll.close()

    assert "stop_requested" not in [c.name for c in load_records(tmp_path)[0]]


def test_the_recorder_names_the_first_collective_where_ranks_diverge(tmp_path: Path) -> None:
    for rank in range(WORLD):
        with fake_rank(rank, record_dir=tmp_path) as coll:
            coll.all_reduce(torch.zeros(3), dist.ReduceOp.SUM, "grads")
            if rank == 0:
                coll.broadcast(torch.zeros(2, dtype=torch.int64), 0, "published_version")
            coll.all_reduce(torch.zeros(1), dist.ReduceOp.MAX, "step_stats_max")

    div = find_divergence(load_records(tmp_path))

    assert div is not None and div.index == 1
    assert div.calls[0] is not None and div.calls[0].name == "published_version"
    assert div.calls[1] is not None and div.calls[1].name == "step_stats_max"


def test_step_statistics_are_two_fixed_size_reductions_whatever_the_rank_saw(tmp_path: Path) -> None:
    with fake_rank(0, record_dir=tmp_path) as coll:
        summary = global_summary(coll, 2, StepBatch.of(_episodes(3, 0), [0.0, 1.0, 5.0]))
    with fake_rank(1, record_dir=tmp_path) as coll:
        global_summary(coll, 2, StepBatch.empty())

    assert find_divergence(load_records(tmp_path)) is None
    assert summary.episodes == 3 and summary.staleness_max == 5
    assert summary.staleness_hist == {"0": 1, "1": 1, "3": 1}  # beyond max_staleness: one overflow bucket


class _NoPublisher:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"rank 1 used the publisher ({name})")


async def test_only_rank_0_publishes_the_others_learn_the_version_by_one_broadcast(tmp_path: Path) -> None:
    with fake_rank(1, record_dir=tmp_path) as coll:
        publication = VersionPublication(
            _NoPublisher(),
            _NoPublisher(),
            _NoPublisher(),
            coll,  # type: ignore[arg-type]
            "unused:0",
            retry_s=1.0,
        )
        version, flag = await publication.publish(3, flag=True)

    # with the fake group rank 1 keeps its zeros: a real broadcast brings rank 0's version and flag
    assert (version, flag) == (0, False)
    [call] = load_records(tmp_path)[1]
    assert (call.op, call.name, call.src, call.shapes) == ("broadcast", "published_version", 0, ((2,),))


async def test_collectives_leave_the_event_loop_only_when_ranks_communicate() -> None:
    """Ranks that communicate wait for each other in a worker thread (the event loop stays free); a single process,
    whose collectives are identities, runs them inline: no thread hand-offs on a step's path."""

    def where(coll: Collectives) -> str:
        coll.broadcast(torch.zeros(2, dtype=torch.int64), 0, "published_version")
        return threading.current_thread().name

    main = threading.current_thread().name
    alone = await Collectives(None, timeout_s=10).off_loop(where, Collectives(None, timeout_s=10))
    with fake_rank(0) as coll:
        together = await coll.off_loop(where, coll)

    assert alone == main and together != main
