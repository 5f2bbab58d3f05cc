"""The step-time breakdown of a real short run (every part real: gRPC services on port 0, a redis-server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.common.metrics_row import TIME_SHARES, RlRow, parse_row, time_shares
from relayrl.trainer.steptime import PARTS
from tests.conftest import RedisServer
from tests.integration.stack import run_stack, stack_config

pytestmark = pytest.mark.integration

PART_FIELDS = [f"time_{p}_s" for p in PARTS]
PUBLISH_FIELDS = ["time_publish_serialise_s", "time_publish_transfer_s", "time_publish_swap_s", "time_publish_probe_s"]


@pytest.mark.parametrize("overlap", [False, True])
async def test_every_step_row_breaks_its_wall_time_into_parts_that_add_up_to_it(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer, overlap: bool
) -> None:
    cfg = stack_config(
        tmp_path / "run",
        tiny_model_dir,
        dataset_path,
        redis_server.url,
        f"trainer.publication.overlap={str(overlap).lower()}",
    )

    out = await run_stack(cfg, tiny_model_dir)

    rows = [parse_row(r) for r in out["rows"]]
    assert all(isinstance(r, RlRow) and not r.missing & {"time_wall_s", *PART_FIELDS} for r in rows)
    for r in out["rows"]:
        parts = [r[f] for f in PART_FIELDS]
        assert all(p >= 0 for p in parts) and r["time_other_s"] >= 0
        # the parts and "other" add up to the wall (float sums of a few terms: 1e-9 s is far above rounding)
        assert sum(parts) + r["time_other_s"] == pytest.approx(r["time_wall_s"], rel=0, abs=1e-9)
        # nothing counted twice: the measured parts alone never exceed the wall
        assert sum(parts) <= r["time_wall_s"] + 1e-9
        assert r["time_fwd_bwd_s"] > 0 and r["time_optimizer_s"] > 0 and r["time_publish_s"] > 0
        assert all(r[f] >= 0 for f in PUBLISH_FIELDS) and r["time_publish_swap_s"] > 0
        # the data wait splits into waiting for generation and the batch in transit, nothing else
        assert r["time_data_generating_s"] >= 0 and r["time_data_transit_s"] >= 0
        assert r["time_data_generating_s"] + r["time_data_transit_s"] == pytest.approx(
            r["time_data_s"], rel=0, abs=1e-9
        )
        # the wait for the previous push lies within the publication's part
        assert 0 <= r["time_publish_wait_s"] <= r["time_publish_s"]
        if not overlap:  # the step waits for its push: the publication's own parts lie within it
            assert sum(r[f] for f in PUBLISH_FIELDS) <= r["time_publish_s"] + 1e-9
            # and no push is ever left in flight to wait for (an await of nothing: far below a millisecond)
            assert r["time_publish_wait_s"] < 1e-3
        # with overlap the step waits only for the snapshot (and a push still in flight); the parts are those of
        # the last verified push, which ran in the background
    # each wall is the time between consecutive rows (same monotonic clock as time_s; rounding only)
    for prev, cur in zip(out["rows"], out["rows"][1:], strict=False):
        assert cur["time_wall_s"] == pytest.approx(cur["time_s"] - prev["time_s"], rel=0, abs=1e-6)
    # checkpoint.every=2: the checkpoint after step 2 is counted in step 3's row, none before it
    assert out["rows"][0]["time_checkpoint_s"] == 0 and out["rows"][1]["time_checkpoint_s"] == 0
    assert out["rows"][2]["time_checkpoint_s"] > 0
    shares = time_shares(rows)
    assert sum(shares[name] for name in TIME_SHARES) == pytest.approx(1.0, rel=0, abs=1e-9)
    assert 0 <= shares["generation"] <= shares["data_wait"]  # the wait for generation is part of the data wait
    assert shares["plumbing"] == pytest.approx(1.0 - shares["compute"] - shares["generation"], rel=0, abs=1e-12)
