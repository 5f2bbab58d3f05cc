"""A sharded trainer's ranks must share one checkpoint folder (each writes its shards there and reads the others' on
a resume): two gloo ranks with one folder start; with a folder each (trainer pods with volumes of their own) both
refuse at start-up with the same error, naming the field, the blind rank and the fix."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from relayrl.config.typed import ConfigError
from tests.conftest import free_port
from tests.distributed.gloo import gloo_group

pytestmark = pytest.mark.distributed

JOIN_S = 60.0  # spawn + import torch + rendezvous + two collectives


def _rank(rank: int, port: int, folders: list[str], out: str) -> None:
    from relayrl.trainer.checkpoint import check_shared_folder
    from relayrl.trainer.collectives import Collectives

    with gloo_group(rank, port):
        import torch.distributed as dist

        coll = Collectives(dist.group.WORLD, 30.0)
        try:
            check_shared_folder(Path(folders[rank]), coll, dp_shard=2)
            result = {"ok": True}
        except ConfigError as exc:
            result = {"ok": False, "field": exc.field, "message": str(exc)}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _check(tmp_path: Path, folders: list[Path]) -> list[dict[str, object]]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, [str(f) for f in folders], str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_S)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_ranks_that_share_the_checkpoint_folder_start_and_leave_no_marker(tmp_path: Path) -> None:
    shared = tmp_path / "checkpoints"

    assert _check(tmp_path, [shared, shared]) == [{"ok": True}, {"ok": True}]
    assert list(shared.iterdir()) == []


def test_ranks_with_a_folder_each_both_refuse_naming_the_blind_rank_and_the_fix(tmp_path: Path) -> None:
    results = _check(tmp_path, [tmp_path / "pod0" / "checkpoints", tmp_path / "pod1" / "checkpoints"])

    assert results[0] == results[1] and results[0]["ok"] is False
    assert results[0]["field"] == "trainer.distributed.dp_shard"
    message = str(results[0]["message"])
    assert "rank(s) 1 do not see" in message and "trainer.persistence.shared" in message
