"""The real trainer loop on a Redis that fills mid-run: it pauses without dying (no step, no version, no ack while
its writes are refused), and completes the run once memory frees, every entry accounted for once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import redis

from relayrl.common.redis_keys import STREAM_FIELD, RedisKeys
from relayrl.config import RunConfig
from relayrl.trainer.metrics import trainer_metrics
from relayrl.trainer.runtime import Trainer
from tests.conftest import RedisServer
from tests.integration.helpers import inference_server, with_services
from tests.integration.stack import stack_config
from tests.polling import until
from tests.security.test_bad_episodes import GARBAGE, _group

pytestmark = [pytest.mark.security, pytest.mark.integration]

FILL_WITH = """
for i = 1, #ARGV do redis.call('XADD', KEYS[1], '*', 'group', ARGV[i]) end
redis.call('SET', KEYS[2], string.rep('x', 4000000))
return redis.call('XLEN', KEYS[1])
"""


def _groups(*names: str, version: int) -> list[bytes]:
    return [_group(n, version).SerializeToString() for n in names]


async def _fill_mid_run(cfg: RunConfig, model_dir: Path, admin: redis.Redis) -> dict[str, Any]:
    """Train step 1, fill Redis with step 2's entries in one script, record what holds while writes are refused,
    free the memory and let the run finish: what was seen during and after."""
    keys = RedisKeys.from_config(cfg.redis, cfg.name)
    stream_key = keys.stream
    async with inference_server(model_dir) as (target, inf):
        trainer = Trainer(with_services(cfg, target, inf.weights_target))
        metrics = trainer_metrics(trainer)
        for payload in _groups("g0", "g1", version=1):  # the initial weights get version 1
            admin.xadd(stream_key, {STREAM_FIELD: payload})
        train = asyncio.create_task(trainer.train())
        try:
            assert await until(lambda: trainer.progress.step >= 1 or train.done(), 120)
            if train.done():
                train.result()  # the trainer failed before Redis filled
            admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + 1_000_000)
            step2 = [GARBAGE, *_groups("stale", version=1), *_groups("g2", "g3", version=2)]
            admin.eval(FILL_WITH, 2, stream_key, "filler", *step2)
            assert await until(lambda: trainer.redis_backpressure.retries >= 3 or train.done(), 60)
            during = {
                "done": train.done(),
                "step": trainer.progress.step,
                "version": admin.get(keys.version_counter),
                "full": metrics.get_sample_value("relayrl_trainer_redis_full"),
                "dead": admin.xlen(keys.dead_letter),
                "pending": admin.xpending(stream_key, cfg.redis.group)["pending"],
            }
            admin.delete("filler")
            await asyncio.wait_for(train, 120)
        finally:
            train.cancel()
            await asyncio.gather(train, return_exceptions=True)
            await trainer.close()
        info = admin.xinfo_groups(stream_key)[0]
        return {
            "during": during,
            "progress": trainer.progress,
            "info": info,
            "inference": inf.engine.version,
            "retries": metrics.get_sample_value("relayrl_trainer_redis_oom_retries_total"),
            "full": metrics.get_sample_value("relayrl_trainer_redis_full"),
        }


async def test_a_trainer_whose_redis_fills_mid_run_pauses_without_dying_and_completes_the_run_when_memory_frees(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    """Step 1 trains; then Redis fills (in one script with the entries of step 2: an undecodable one, a stale group
    and two fresh ones), the trainer's dead letter is refused and it waits: no step, no version, no ack; memory
    frees and the run completes, every entry accounted for once."""
    cfg = stack_config(
        tmp_path / "run",
        tiny_model_dir,
        dataset_path,
        redis_server.url,
        "trainer.total_steps=2",
        "rollout.max_staleness=0",
        "trainer.checkpoint.every=0",
    )
    admin = redis.Redis(port=redis_server.port)
    keys = RedisKeys.from_config(cfg.redis, cfg.name)
    stream_key = keys.stream

    seen = await _fill_mid_run(cfg, tiny_model_dir, admin)

    assert seen["during"] == {"done": False, "step": 1, "version": b"2", "full": 1.0, "dead": 0, "pending": 4}
    p = seen["progress"]
    assert (p.step, p.groups_trained, p.groups_dropped_stale, p.groups_invalid) == (2, 4, 1, 1)
    assert seen["info"]["pending"] == 0 and seen["info"]["lag"] == 0
    produced = admin.xinfo_stream(stream_key)["entries-added"]
    assert produced == 6 == p.groups_trained + p.groups_dropped_stale + p.groups_invalid + seen["info"]["pending"]
    trained = [json.loads(line) for line in (cfg.output_dir / "trained" / "rank0.jsonl").read_text().splitlines()]
    assert [[g for g, _ in row["groups"]] for row in trained] == [["g0", "g1"], ["g2", "g3"]]  # each once
    rows = [json.loads(line) for line in cfg.metrics_path.read_text().splitlines()]
    assert [r["weight_version"] for r in rows] == [2, 3] and admin.get(keys.version_counter) == b"3"
    assert seen["inference"] == 3  # no version reused or skipped: 1 (initial), 2, 3
    assert seen["retries"] >= 3 and seen["full"] == 0.0
    assert admin.hgetall(keys.dropped("stale")) == {b"stale": b"2"}
    assert admin.hlen(keys.invalid) == 1 and admin.xlen(keys.dead_letter) == 1
