"""The chart's multi-node trainer, run for real as two simulated pods (tests/deploy/pods.py) on this machine.

Each scenario ends in a clean group or a clean failure, never a hang: pod 0 (the rendezvous store's host) coming
up after pod 1; pod 0 lost mid-run and recreated; two pods created from different configs. A finished run stays up,
idle, until the pods are stopped. That the chart's store read timeout (900 s) outlasts torch's default of 60 s is
checked at render (tests/deploy/test_helm_lifecycle.py); where that default gives up was measured once
(docs/dev/deploy_records.md): a late pod 0 here proves the group still forms, not the timeout.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from relayrl.client import RolloutClient
from tests.conftest import RedisServer
from tests.deploy.pods import Release, render, values

pytestmark = [pytest.mark.slow(seconds=120), pytest.mark.distributed, pytest.mark.integration]

STEPS = 6
# pod 1's agent waits for the store pod 0 hosts (image pull, GPU node scale-up, volume attach). Until 2026-12-07
# this was 90 s, past torch's default store read timeout, which proved nothing more: that default's one retry can
# land after pod 0 is up (it gives up 135 s after the start when pod 0 never comes, docs/dev/deploy_records.md)
POD0_DELAY_S = 20
LOST_RUN_STEPS = 12  # checkpoints at 3, 6, 9, 12: pod 0 is lost after the first
OTHER_SERVICES = ("inference", "reward", "rollout")


@pytest.fixture
def release_dir(tmp_path: Path) -> Path:
    (tmp_path / "runs").mkdir()
    return tmp_path


@pytest.fixture
def cleanup() -> Iterator[list[Release]]:
    releases: list[Release] = []
    yield releases
    for release in releases:
        release.stop_all()


def _release(
    tmp: Path, redis: RedisServer, model: Path, cleanup: list[Release], steps: int = STEPS, **trainer: object
) -> Release:
    release = Release(tmp, render(values(redis.url, model, tmp / "runs", steps, **trainer)))
    cleanup.append(release)
    return release


async def _rollout_control(release: Release, pause: bool) -> None:
    """Pause or resume generation through rollout's control API, with the release's control token."""
    port = yaml.safe_load(release.config.read_text())["rollout"]["server"]["port"]
    async with RolloutClient(f"127.0.0.1:{port}", token=release.env["RELAYRL_CONTROL_TOKEN"]) as rollout:
        status = await (rollout.pause("test: pod 0 is about to be lost") if pause else rollout.resume())
    assert status.paused == pause


def _finished(release: Release, index: int) -> bool:
    return "the run is finished" in release.log(f"trainer-{index}")


def _steps(release: Release) -> list[int]:
    path = release.output(0) / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_pod_zero_started_late_still_gets_rank_zero_and_the_finished_run_stays_up_until_stopped(
    release_dir: Path, redis_server: RedisServer, demo_model: Path, cleanup: list[Release]
) -> None:
    release = _release(release_dir, redis_server, demo_model, cleanup)
    release.start_services("inference", "reward")
    release.start_trainer_pod(1)
    started = time.monotonic()
    while time.monotonic() - started < POD0_DELAY_S:  # pod 0's image pull / GPU node scale-up / volume attach
        assert release.procs["trainer-1"].poll() is None, f"pod 1 gave up:\n{release.log('trainer-1')[-3000:]}"
        time.sleep(1)
    release.start_trainer_pod(0)
    release.start_services("rollout")

    release.wait(
        lambda: _finished(release, 0) and _finished(release, 1), 300, "both pods to finish the run", OTHER_SERVICES
    )

    # finished, yet up (a StatefulSet would restart an exit): both agents still run, nothing crashed
    assert [release.procs[f"trainer-{i}"].poll() for i in (0, 1)] == [None, None]
    assert "[trainer rank=0]" in release.log("trainer-0") and "[trainer rank=1]" not in release.log("trainer-0")
    assert "[trainer rank=1]" in release.log("trainer-1") and "[trainer rank=0]" not in release.log("trainer-1")
    assert _steps(release) == list(range(1, STEPS + 1))
    rows = [json.loads(line) for line in (release.output(0) / "metrics.jsonl").read_text().splitlines()]
    assert {r["world_size"] for r in rows} == {2}
    checkpoints = release.output(0) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000003", "step_000006"]
    assert not (release.output(1) / "checkpoints").exists()  # pod 1 never needs pod 0's volume
    # SIGTERM (a drain, `helm uninstall`): each agent ends its ranks within its shutdown timeout, none by SIGKILL
    # (torchrun itself then exits 1 with a SignalException, which Kubernetes ignores for a terminating pod)
    assert [release.stop(f"trainer-{i}") for i in (1, 0)] == [1, 1]
    for i in (0, 1):
        log = release.log(f"trainer-{i}")
        assert "closing signal SIGTERM" in log and "closing signal SIGKILL" not in log
        assert "SignalException" in log and "got signal: 15" in log
    assert release.stop("rollout") == 0
    state = json.loads((release.rollout_volume / "sim-run" / "rollout_state.json").read_text())
    assert state["groups_produced"] > 0  # rollout's state is on its own volume, under the run's directory


async def test_pod_zero_lost_mid_run_and_recreated_regroups_and_resumes_from_its_checkpoint(
    release_dir: Path, redis_server: RedisServer, demo_model: Path, cleanup: list[Release]
) -> None:
    release = _release(release_dir, redis_server, demo_model, cleanup, steps=LOST_RUN_STEPS)
    release.start_services("inference", "reward")
    for index in (0, 1):
        release.start_trainer_pod(index, restart=True)
    release.start_services("rollout")
    first = release.output(0) / "checkpoints" / "step_000003"
    release.wait(first.exists, 300, "the first checkpoint", OTHER_SERVICES)
    # generation is held, so the run cannot finish before pod 0 is lost: the trainer runs out of episodes within
    # the staleness window (a step or two past the checkpoint), far from its last step
    await _rollout_control(release, pause=True)

    release.kill("trainer-0")  # pod 0 deleted: its agent, the rendezvous store and rank 0 vanish at once
    release.start_trainer_pod(0, restart=True)  # the StatefulSet recreates it under the same name
    await _rollout_control(release, pause=False)

    release.wait(
        lambda: _finished(release, 0) and _finished(release, 1), 420, "the regrouped pods to finish", OTHER_SERVICES
    )
    log0 = release.log("trainer-0")
    assert "resumed from" in log0 and "step_00000" in log0  # from a checkpoint, not from scratch
    assert (release.output(0) / "checkpoints" / f"step_{LOST_RUN_STEPS:06d}").is_dir()
    assert max(_steps(release)) == LOST_RUN_STEPS
    assert [release.procs[f"trainer-{i}"].poll() for i in (0, 1)] == [None, None]


def test_pods_created_from_different_configs_never_form_a_group_and_fail_cleanly(
    release_dir: Path, redis_server: RedisServer, demo_model: Path, cleanup: list[Release]
) -> None:
    timing = {"rendezvous": {"joinTimeoutSeconds": 20, "readTimeoutSeconds": 20}}
    before = values(redis_server.url, demo_model, release_dir / "runs", STEPS, **timing)
    after = copy.deepcopy(before)
    after["config"]["trainer"]["total_steps"] = STEPS + 2  # `helm upgrade` with a changed run config
    old = Release(release_dir, render(before))
    cleanup.append(old)
    (release_dir / "new").mkdir()
    new = Release(release_dir / "new", render(after))
    # a rolling update (or a pod recreated after `helm upgrade`) puts a new-config pod 1 next to the old pod 0, at
    # the same rendezvous endpoint; its rendezvous id carries the new config's checksum
    assert new.trainer_script() != old.trainer_script().replace(str(old.config), str(new.config))
    old.start_trainer_pod(0)
    old.start_trainer_pod(1, script=new.trainer_script(), env=new.trainer_env())

    old.wait(lambda: all(old.procs[f"trainer-{i}"].poll() is not None for i in (0, 1)), 180, "both agents to give up")

    assert all(old.procs[f"trainer-{i}"].poll() != 0 for i in (0, 1))
    logs = [old.log(f"trainer-{i}") for i in (0, 1)]
    for log in logs:
        assert "[trainer rank=" not in log, log[-3000:]  # no worker ever started: no mixed group
        # the first to reach its join timeout gives up; the other may first lose the store that pod 0 hosted
        assert "RendezvousTimeoutError" in log or "RendezvousConnectionError" in log, log[-3000:]
    assert any("RendezvousTimeoutError" in log for log in logs)
