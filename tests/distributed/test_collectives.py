"""Collectives across real gloo ranks: correct results, recorded sequences, and diverged programs that fail on
every rank within the timeout instead of hanging, with the first divergence named from the records."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relayrl.trainer.collective_debug import CollectiveCall, find_divergence, load_records, main
from relayrl.trainer.collectives import Collectives, CollectiveTimeout
from tests.conftest import free_port

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2
RUN_TIMEOUT_S = 3.0  # per-collective timeout of the diverged runs
LATE_MARGIN_S = 2.0  # how much later than the timeout a rank may fail
JOIN_S = 60.0  # the test's own bound on its ranks: spawn + import torch + rendezvous + collectives
PG_TIMEOUT_S = 30.0  # init_process_group timeout: bounds the rendezvous; collectives use RUN_TIMEOUT_S
EXIT_AFTER_TIMEOUT = 3  # exit code of a rank that caught a CollectiveTimeout


# ----------------------------------------------------------------------------------------------------------------
# The programs the ranks run (module level: spawned children import them by name)


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    return {
        "grad": torch.tensor([0.1, -2.5, 3.3, 7.0]) * (rank + 1),
        "loss": torch.tensor([1.0, 5.0, -3.0]) if rank == 0 else torch.tensor([2.0, -1.0, -4.0]),
        "weights": torch.arange(6.0).reshape(2, 3) + 100.0 * rank,
        "count": torch.tensor([1.0, 2.0]) * (rank + 1),
        "tokens": torch.tensor([[0.5]]) * (rank + 1),
    }


def _program_same(coll: Collectives, rank: int) -> dict[str, torch.Tensor]:
    t = _inputs(rank)
    coll.all_reduce(t["grad"], dist.ReduceOp.SUM, "grad")
    coll.all_reduce(t["loss"], dist.ReduceOp.MAX, "loss")
    coll.broadcast(t["weights"], src=0, name="weights")
    coll.all_reduce_coalesced([t["count"], t["tokens"]], dist.ReduceOp.SUM, "stats")
    return t


def _program_op_mismatch(coll: Collectives, rank: int) -> dict[str, torch.Tensor]:
    """Collective #1: rank 0 all-reduces ``loss``, rank 1 broadcasts it."""
    t = _inputs(rank)
    coll.all_reduce(t["grad"], dist.ReduceOp.SUM, "grad")
    if rank == 0:
        coll.all_reduce(t["loss"], dist.ReduceOp.MAX, "loss")
    else:
        coll.broadcast(t["loss"], src=0, name="loss")
    coll.broadcast(t["weights"], src=0, name="weights")
    return t


def _program_rank1_skips(coll: Collectives, rank: int) -> dict[str, torch.Tensor]:
    """Rank 1 skips collective #1 (``loss``), so its #1 is the ``weights`` broadcast."""
    t = _inputs(rank)
    coll.all_reduce(t["grad"], dist.ReduceOp.SUM, "grad")
    if rank == 0:
        coll.all_reduce(t["loss"], dist.ReduceOp.MAX, "loss")
    coll.broadcast(t["weights"], src=0, name="weights")
    return t


def _program_rank1_stops_early(coll: Collectives, rank: int) -> dict[str, torch.Tensor]:
    """Rank 1 returns before the last collective (an all-reduce: rank 0 cannot finish it alone)."""
    t = _inputs(rank)
    coll.all_reduce(t["grad"], dist.ReduceOp.SUM, "grad")
    coll.broadcast(t["weights"], src=0, name="weights")
    if rank == 0:
        coll.all_reduce_coalesced([t["count"], t["tokens"]], dist.ReduceOp.SUM, "stats")
    return t


PROGRAMS: dict[str, Callable[[Collectives, int], dict[str, torch.Tensor]]] = {
    "same": _program_same,
    "op_mismatch": _program_op_mismatch,
    "rank1_skips": _program_rank1_skips,
    "rank1_stops_early": _program_rank1_stops_early,
}


def _worker(rank: int, port: int, run_dir: str, program: str, timeout_s: float) -> None:
    """One rank: rendezvous over TCP, run ``program`` through Collectives, save the outcome to result<R>.pt."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    coll = Collectives(dist.group.WORLD, timeout_s, record_dir=Path(run_dir) / "collectives")
    result = Path(run_dir) / f"result{rank}.pt"
    start = time.monotonic()
    try:
        outputs = PROGRAMS[program](coll, rank)
    except CollectiveTimeout as exc:
        torch.save({"status": "timeout", "elapsed_s": time.monotonic() - start, "message": str(exc)}, result)
        coll.close()
        # gloo cannot cancel the collective this rank gave up on: a normal interpreter exit waits for it in the
        # process group's destructor until PG_TIMEOUT_S (destroy_process_group and abort do not help), so a
        # rank exits at once after a CollectiveTimeout, as a trainer should.
        os._exit(EXIT_AFTER_TIMEOUT)
    torch.save({"status": "ok", "elapsed_s": time.monotonic() - start, "outputs": outputs}, result)
    coll.close()
    dist.destroy_process_group()


def _run_ranks(run_dir: Path, program: str, timeout_s: float) -> tuple[list[int | None], dict[int, dict[str, Any]]]:
    """Run ``program`` on WORLD_SIZE spawned ranks; returns their exit codes (None: killed at JOIN_S) and results.

    One Process per rank rather than torch.multiprocessing.start_processes: its join terminates every rank at
    the first failure, which would hide whether the other ranks fail by themselves.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, port, str(run_dir), program, timeout_s), daemon=True)
        for rank in range(WORLD_SIZE)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + JOIN_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        exit_codes = [p.exitcode for p in procs]
    finally:
        for p in procs:  # never leave a rank behind, whatever happened above
            if p.is_alive():
                p.kill()
            p.join(10)
    assert not any(p.is_alive() for p in procs)
    results = {
        rank: torch.load(run_dir / f"result{rank}.pt", weights_only=True)
        for rank in range(WORLD_SIZE)
        if (run_dir / f"result{rank}.pt").exists()
    }
    return exit_codes, results


# ----------------------------------------------------------------------------------------------------------------
# Real runs


def test_two_ranks_same_sequence_get_reduced_values_and_records_agree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exit_codes, results = _run_ranks(tmp_path, "same", timeout_s=20.0)

    assert exit_codes == [0, 0], results
    in0, in1 = _inputs(0), _inputs(1)
    expected = {
        "grad": in0["grad"] + in1["grad"],
        "loss": torch.tensor([2.0, 5.0, -3.0]),
        "weights": in0["weights"],
        "count": torch.tensor([3.0, 6.0]),
        "tokens": torch.tensor([[1.5]]),
    }
    for rank in range(WORLD_SIZE):
        assert results[rank]["status"] == "ok"
        for key, want in expected.items():
            # Exact: with 2 ranks a SUM is one IEEE float32 addition (commutative, the same rounding in gloo and
            # here), MAX and broadcast copy values, and the inputs are exact float32 constants.
            torch.testing.assert_close(results[rank]["outputs"][key], want, rtol=0, atol=0, msg=f"{rank} {key}")
    assert sorted(p.name for p in (tmp_path / "collectives").iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    records = load_records(tmp_path)
    assert [c.op for c in records[0]] == ["all_reduce", "all_reduce", "broadcast", "all_reduce"]
    assert [(c.name, c.reduce_op, c.src) for c in records[1]] == [
        ("grad", "SUM", None),
        ("loss", "MAX", None),
        ("weights", None, 0),
        ("stats", "SUM", None),
    ]
    assert records[0][3].shapes == ((3,),)  # the coalesced buffer: 2 + 1 elements
    assert find_divergence(records) is None
    capsys.readouterr()
    assert main([str(tmp_path)]) == 0
    assert "all 2 ranks agree on 4 collectives" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("program", "rank1_call"),
    [
        ("op_mismatch", ("broadcast", "loss")),
        ("rank1_skips", ("broadcast", "weights")),
    ],
)
def test_two_ranks_diverged_program_both_time_out_and_divergence_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], program: str, rank1_call: tuple[str, str]
) -> None:
    exit_codes, results = _run_ranks(tmp_path, program, timeout_s=RUN_TIMEOUT_S)

    assert exit_codes == [EXIT_AFTER_TIMEOUT, EXIT_AFTER_TIMEOUT], results
    for rank in range(WORLD_SIZE):
        assert results[rank]["status"] == "timeout"
        assert f"rank {rank}: collective #1" in results[rank]["message"]
        assert results[rank]["elapsed_s"] < RUN_TIMEOUT_S + LATE_MARGIN_S
    div = find_divergence(load_records(tmp_path))
    assert div is not None
    assert div.index == 1
    call0, call1 = div.calls[0], div.calls[1]
    assert call0 is not None and call1 is not None
    assert (call0.op, call0.name, call0.reduce_op) == ("all_reduce", "loss", "MAX")
    assert (call1.op, call1.name, call1.src) == (*rank1_call, 0)
    assert "op" in div.differing_fields
    capsys.readouterr()
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "ranks diverge at collective #1" in out
    assert "rank 0: all_reduce(loss)" in out
    assert f"rank 1: {rank1_call[0]}({rank1_call[1]})" in out


def test_rank_that_returns_before_last_all_reduce_makes_peer_fail_and_is_reported_as_ended_early(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exit_codes, results = _run_ranks(tmp_path, "rank1_stops_early", timeout_s=RUN_TIMEOUT_S)

    assert exit_codes == [EXIT_AFTER_TIMEOUT, 0], results
    assert results[0]["status"] == "timeout"
    assert "collective #2 all_reduce(stats)" in results[0]["message"]
    assert results[0]["elapsed_s"] < RUN_TIMEOUT_S + LATE_MARGIN_S
    div = find_divergence(load_records(tmp_path))
    assert div is not None
    assert (div.index, div.ended_early, div.lengths) == (2, [1], {0: 3, 1: 2})
    capsys.readouterr()
    assert main([str(tmp_path)]) == 1
    assert "rank 1: no call: its sequence ended after 2 collectives" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------------
# find_divergence and main on hand-written records (no processes)


def _rec(
    index: int,
    op: str = "all_reduce",
    name: str = "grad",
    shapes: list[list[int]] | None = None,
    dtypes: list[str] | None = None,
    reduce_op: str | None = "SUM",
    src: int | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "op": op,
        "name": name,
        "group": "default",
        "world_size": 2,
        "shapes": [[4]] if shapes is None else shapes,
        "dtypes": ["float32"] if dtypes is None else dtypes,
        "reduce_op": reduce_op,
        "src": src,
    }


def test_find_divergence_identical_sequences_returns_none() -> None:
    seq = [_rec(0), _rec(1, op="broadcast", name="weights", reduce_op=None, src=0)]

    assert find_divergence({0: seq, 1: list(seq)}) is None


def test_find_divergence_no_ranks_or_empty_sequences_returns_none() -> None:
    assert find_divergence({}) is None
    assert find_divergence({0: [], 1: []}) is None


def test_find_divergence_shape_differs_at_second_call_names_index_and_fields() -> None:
    rank0 = [_rec(0), _rec(1, name="loss", shapes=[[4]]), _rec(2)]
    rank1 = [_rec(0), _rec(1, name="loss", shapes=[[5]], dtypes=["bfloat16"]), _rec(2)]

    div = find_divergence({0: rank0, 1: rank1})

    assert div is not None
    assert div.index == 1
    assert div.differing_fields == ("shapes", "dtypes")
    assert div.calls[0] == CollectiveCall.from_record(rank0[1])
    assert div.calls[1] == CollectiveCall.from_record(rank1[1])
    assert div.ended_early == []


def test_find_divergence_one_rank_ended_early_names_it_with_no_call() -> None:
    full = [_rec(0), _rec(1, name="loss"), _rec(2, op="broadcast", name="weights", reduce_op=None, src=0)]

    div = find_divergence({0: full, 1: full[:2], 2: full})

    assert div is not None
    assert div.index == 2
    assert div.calls[1] is None
    assert div.calls[0] == div.calls[2] == CollectiveCall.from_record(full[2])
    assert div.ended_early == [1]
    assert div.differing_fields == ()
    assert div.lengths == {0: 3, 1: 2, 2: 3}


def test_find_divergence_first_of_several_differences_is_reported() -> None:
    rank0 = [_rec(0), _rec(1, reduce_op="SUM"), _rec(2, op="broadcast", reduce_op=None, src=0)]
    rank1 = [_rec(0), _rec(1, reduce_op="MAX")]

    div = find_divergence({0: rank0, 1: rank1})

    assert div is not None
    assert (div.index, div.differing_fields, div.ended_early) == (1, ("reduce_op",), [])


def _write_run(run_dir: Path, records_by_rank: dict[int, list[dict[str, Any]]], tail: str = "") -> None:
    folder = run_dir / "collectives"
    folder.mkdir(parents=True)
    for rank, records in records_by_rank.items():
        (folder / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_main_divergent_files_returns_1_and_names_index_and_both_calls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_run(
        tmp_path,
        {
            0: [_rec(0), _rec(1, name="loss", reduce_op="MAX")],
            1: [_rec(0), _rec(1, op="broadcast", name="loss", reduce_op=None, src=0)],
        },
    )

    code = main([str(tmp_path)])

    out = capsys.readouterr().out
    assert code == 1
    assert "ranks diverge at collective #1 (differs in op, reduce_op, src)" in out
    assert "rank 0: all_reduce(loss) reduce_op=MAX" in out
    assert "rank 1: broadcast(loss) src=0" in out
    assert "last collective all ranks agree on: #0 all_reduce(grad)" in out


def test_main_records_folder_given_directly_with_unterminated_last_line_returns_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a rank killed while writing its last line leaves it unterminated; that line is dropped
    _write_run(tmp_path, {0: [_rec(0)], 1: [_rec(0)]}, tail='{"index": 1, "op": "all_')

    code = main([str(tmp_path / "collectives")])

    assert code == 0
    assert "all 2 ranks agree on 1 collectives" in capsys.readouterr().out


def test_main_missing_rank_file_counts_rank_as_ended_early(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path, {0: [_rec(0)]})

    code = main([str(tmp_path)])

    out = capsys.readouterr().out
    assert code == 1
    assert "rank 1 left no record file" in out
    assert "ranks diverge at collective #0" in out


@pytest.mark.parametrize("make", ["missing_folder", "empty_folder", "malformed_line"])
def test_main_no_readable_records_returns_2_with_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: str
) -> None:
    if make == "empty_folder":
        (tmp_path / "collectives").mkdir()
    elif make == "malformed_line":
        _write_run(tmp_path, {0: [_rec(0)]}, tail="not json\n")
    run_dir = tmp_path / "nope" if make == "missing_folder" else tmp_path

    code = main([str(run_dir)])

    assert code == 2
    assert "collective records" in capsys.readouterr().err
