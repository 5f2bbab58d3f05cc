"""A sharded trainer (FSDP2, dp_shard = 4) over two simulated pods of two ranks each (tests/deploy/pods.py): every
rank writes its checkpoint shards into one folder and reads the others' on a resume. On one folder that every pod
mounts (trainer.persistence.shared), pod 0 lost after a checkpoint comes back and the group resumes from it; with a
folder per pod (a claim that is not really shared), both pods refuse at start-up, naming the field and the fix,
before any checkpoint could be split across volumes."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import yaml

from relayrl.client import RolloutClient
from tests.conftest import RedisServer
from tests.deploy.pods import Release, render, values

pytestmark = [pytest.mark.slow(seconds=55), pytest.mark.distributed, pytest.mark.integration]

STEPS = 6  # checkpoints at 3 and 6: pod 0 is lost after the first
SERVICES = ("inference", "reward", "rollout")


def _sharded(tmp: Path, redis: RedisServer, model: Path, persistence: dict[str, object]) -> dict[str, object]:
    (tmp / "runs").mkdir()
    sharded = values(redis.url, model, tmp / "runs", STEPS, nprocPerNode=2, persistence=persistence)
    sharded["trainer"]["persistence"]["mountPath"] = str(tmp / "runs")  # type: ignore[index]
    sharded["config"]["trainer"]["distributed"] = {"dp_shard": 4}  # type: ignore[index]
    return sharded


def _finished(release: Release, index: int) -> bool:
    return "the run is finished" in release.log(f"trainer-{index}")


async def _pause(release: Release, pause: bool) -> None:
    port = yaml.safe_load(release.config.read_text())["rollout"]["server"]["port"]
    async with RolloutClient(f"127.0.0.1:{port}", token=release.env["RELAYRL_CONTROL_TOKEN"]) as rollout:
        await (rollout.pause("test: pod 0 is about to be lost") if pause else rollout.resume())


async def test_sharded_pods_on_one_shared_folder_resume_from_their_checkpoint_after_pod_zero_is_lost(
    tmp_path: Path, redis_server: RedisServer, demo_model: Path
) -> None:
    release = Release(tmp_path, render(_sharded(tmp_path, redis_server, demo_model, {"shared": True})))
    assert release.volumes[0] == release.volumes[1]
    try:
        release.start_services("inference", "reward")
        for index in (0, 1):
            release.start_trainer_pod(index, restart=True)
        release.start_services("rollout")
        first = release.output(0) / "checkpoints" / "step_000003"
        await asyncio.to_thread(release.wait, first.exists, 420, "the first checkpoint", SERVICES)
        assert len(list((first / "dcp").glob("*.distcp"))) == 4  # every rank's shards, in the one folder
        await _pause(release, pause=True)  # the run cannot finish before pod 0 is lost

        release.kill("trainer-0")
        release.start_trainer_pod(0, restart=True)
        await _pause(release, pause=False)

        done = lambda: _finished(release, 0) and _finished(release, 1)  # noqa: E731
        await asyncio.to_thread(release.wait, done, 480, "the regrouped pods to finish", SERVICES)
    finally:
        release.stop_all()
    log0 = release.log("trainer-0")
    assert re.search(r"resumed from \S*step_00000[3-6]", log0), log0[-3000:]  # from a checkpoint, not from scratch
    rows = [json.loads(line) for line in (release.output(0) / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == STEPS and {r["world_size"] for r in rows} == {4}
    assert (release.output(0) / "checkpoints" / f"step_{STEPS:06d}" / "dcp").is_dir()


def test_sharded_pods_with_a_folder_each_refuse_at_start_up_naming_the_field_and_the_fix(
    tmp_path: Path, redis_server: RedisServer, demo_model: Path
) -> None:
    claimed = _sharded(tmp_path, redis_server, demo_model, {"existingClaim": "not-really-shared"})
    claimed["trainer"]["maxRestarts"] = 0  # type: ignore[index]  # a refusal is final: torchrun's 3 restarts repeat it
    release = Release(tmp_path, render(claimed), separate_volumes=True)
    assert release.volumes[0] != release.volumes[1]
    try:
        release.start_services("inference", "reward")
        for index in (0, 1):
            release.start_trainer_pod(index)
        exited = lambda: all(release.procs[f"trainer-{i}"].poll() is not None for i in (0, 1))  # noqa: E731
        release.wait(exited, 300, "both pods to refuse")
    finally:
        release.stop_all()
    for index in (0, 1):
        log = release.log(f"trainer-{index}")
        assert "trainer.distributed.dp_shard = 4" in log and "do not see the folder rank 0 writes" in log, log[-3000:]
        assert "trainer.persistence.shared" in log
    assert not list(release.volumes[0].rglob("step_*"))  # refused before any checkpoint
