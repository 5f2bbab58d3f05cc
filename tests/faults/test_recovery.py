"""Fault tests with real processes: kill -9 a service mid-run, restart with --resume auto, check the books.

"Effective" training: the groups whose effect is in the final weights, i.e. those an incarnation trained up to
the checkpoint the next incarnation resumed from, plus everything the last incarnation trained
(read from <run>/trained/rank*.jsonl, which every trainer rank appends per step).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, RedisServer, free_port
from tests.polling import wait_for

pytestmark = [pytest.mark.slow(seconds=155), pytest.mark.integration]

BASE = ["--set", "trainer.checkpoint.every=5", "--set", "rollout.max_new_tokens=2"]


def _start(out: Path, model: Path, steps: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "run",
            "examples/quickstart.yaml",
            "--out",
            str(out),
            "--set",
            f"model.path={model}",
            "--set",
            f"trainer.total_steps={steps}",
            *BASE,
            *extra,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _rows(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen[str], timeout: float = 240) -> None:
    wait_for(lambda: any(r.get("step", 0) >= step for r in _rows(out)), f"step {step}", timeout, alive=proc)


def _pids(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found if int(p) != os.getpid()]


def _kill9(pattern: str) -> None:
    pids = _pids(pattern)
    assert pids, f"no process matches {pattern!r}"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def _effective_groups(out: Path) -> list[tuple[str, int]]:
    """(group id, prompt seq) of every group whose effect is in the final weights, in training order."""
    records = [
        json.loads(line) for p in sorted((out / "trained").glob("rank*.jsonl")) for line in p.read_text().splitlines()
    ]
    incarnations: list[str] = []
    for r in records:
        if r["incarnation"].rsplit("-", 1)[0] not in incarnations:
            incarnations.append(r["incarnation"].rsplit("-", 1)[0])
    resumed_from = {inc: 0 for inc in incarnations}
    for r in records:
        resumed_from[r["incarnation"].rsplit("-", 1)[0]] = r["resumed_from_step"]
    effective: list[tuple[str, int]] = []
    for i, inc in enumerate(incarnations):
        limit = resumed_from[incarnations[i + 1]] if i + 1 < len(incarnations) else float("inf")
        effective += [
            (g, s)
            for r in records
            if r["incarnation"].rsplit("-", 1)[0] == inc and r["step"] <= limit
            for g, s in r["groups"]
        ]
    return effective


def _aof_commands(aof_dir: Path) -> list[list[bytes]]:
    """Every command in the run's append-only files (RESP arrays of bulk strings), in the manifest's order; a
    command cut short at the end (a kill) is left out."""
    names = [
        line.split()[1]
        for line in (aof_dir / "appendonly.aof.manifest").read_text().splitlines()
        if line.split()[-1] == "i"
    ]
    commands: list[list[bytes]] = []
    for name in names:
        data, pos = (aof_dir / name).read_bytes(), 0
        try:
            while pos < len(data):
                end = data.index(b"\r\n", pos)
                count, pos, command = int(data[pos + 1 : end]), end + 2, []
                for _ in range(count):
                    end = data.index(b"\r\n", pos)
                    size = int(data[pos + 1 : end])
                    command.append(data[end + 2 : end + 2 + size])
                    pos = end + 2 + size + 2
                if pos > len(data):
                    break
                commands.append(command)
        except ValueError:
            pass
    return commands


def _stream_contents(out: Path) -> tuple[list[int], int]:
    """Prompt seqs of every group ever appended to the run's stream, and rollout's watermark, read from the run's
    AOF: the commands it logged (the trainer trims acknowledged entries, so the stream itself keeps only the rest)."""
    import redis

    from relayrl.common.pb.episode_pb2 import EpisodeGroup
    from relayrl.common.redis_keys import PROGRESS_WATERMARK, STREAM_FIELD, RedisKeys
    from relayrl.config import load_run_config

    cfg = load_run_config(Path("examples/quickstart.yaml"))  # the runs here: its redis section and name
    keys = RedisKeys.from_config(cfg.redis, cfg.name)
    server = RedisServer("redis-server", free_port(), out / "redis")
    server.start()
    try:
        client = redis.Redis(port=server.port)
        appended = [
            dict(zip(c[3::2], c[4::2], strict=True))
            for c in _aof_commands(out / "redis" / "appendonlydir")
            if c[0].upper() == b"XADD" and c[1] == keys.stream.encode()
        ]
        assert len(appended) >= client.xlen(keys.stream)  # every entry still there was logged
        seqs = [EpisodeGroup.FromString(fields[STREAM_FIELD]).prompt_seq for fields in appended]
        watermark = int(client.hget(keys.rollout_progress, PROGRESS_WATERMARK) or 0)
        client.close()
    finally:
        server.stop()
    return seqs, watermark


def _finish(proc: subprocess.Popen[str], timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def _check_books(out: Path, steps: int, groups_per_step: int = 8) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    effective = _effective_groups(out)
    ids = Counter(g for g, _ in effective)
    assert [g for g, n in ids.items() if n > 1] == []  # trained twice: 0
    assert len(effective) == steps * groups_per_step == summary["groups_trained"]
    # lost: 0 — every produced group is trained (once), dropped as stale, invalid, or still pending (and still in
    # the stream: only acknowledged entries are trimmed)
    assert summary["groups_pending"] <= summary["stream_length"] <= summary["groups_produced"]
    assert summary["groups_produced"] == (
        summary["groups_trained"]
        + summary["groups_dropped_stale"]
        + summary["groups_invalid"]
        + summary["groups_pending"]
    )
    assert summary["groups_invalid"] == 0
    return summary


def _kill_and_resume(out: Path, model: Path, service: str, steps: int, at_step: int) -> None:
    """Run, kill -9 ``service`` once the run passed ``at_step``, then run again with --resume auto."""
    proc = _start(out, model, steps)
    _wait_for_step(out, at_step, proc)

    _kill9(f"serve {service} {out}")
    first = _finish(proc)
    resumed = _start(out, model, steps, "--resume", "auto")
    second = _finish(resumed)

    assert f"service {service} died" in first
    assert resumed.returncode == 0, second[-3000:]


def test_trainer_killed_mid_run_resumes_without_losing_or_repeating_groups(tmp_path: Path, demo_model: Path) -> None:
    _kill_and_resume(tmp_path / "run", demo_model, "trainer", steps=30, at_step=13)

    summary = _check_books(tmp_path / "run", 30)
    print("trainer kill -9:", summary)


def test_rollout_killed_mid_run_neither_skips_nor_repeats_prompts(tmp_path: Path, demo_model: Path) -> None:
    out = tmp_path / "run"
    _kill_and_resume(out, demo_model, "rollout", steps=20, at_step=8)

    _check_books(out, 20)
    trained = [s for _, s in _effective_groups(out)]
    assert len(trained) == len(set(trained))  # no prompt trained twice
    in_stream, watermark = _stream_contents(out)
    assert len(in_stream) == len(set(in_stream))  # no prompt appended twice (append + record are one MULTI)
    assert set(range(watermark)) <= set(in_stream)  # no prompt below the watermark skipped
    assert watermark >= 20 * 8


def test_n_steps_then_resume_for_n_more_consumes_the_same_prompts_as_2n_straight(
    tmp_path: Path, demo_model: Path
) -> None:
    # on-policy (max_staleness 0): exactly one step of groups is admitted at a time, so the prompt order is fixed
    sync = ["--set", "rollout.max_staleness=0", "--set", "trainer.checkpoint.every=10"]
    straight = tmp_path / "straight"
    proc = _start(straight, demo_model, 20, *sync)
    _finish(proc)
    assert proc.returncode == 0

    split = tmp_path / "split"
    first = _start(split, demo_model, 10, *sync)  # N steps; the stack stops with groups for step N+1 in flight
    _finish(first)
    second = _start(split, demo_model, 20, "--resume", "auto", *sync)
    _finish(second)

    assert first.returncode == 0 and second.returncode == 0
    a = sorted(s for _, s in _effective_groups(straight))
    b = sorted(s for _, s in _effective_groups(split))
    assert a == b == list(range(20 * 8))  # the same prompt seqs, each once
    steps = [r["step"] for r in _rows(split) if r.get("phase", "rl") == "rl"]
    assert steps == list(range(1, 21)) and _rows(straight)[-1]["step"] == 20  # 2N steps executed, none twice
    assert json.loads((split / "summary.json").read_text())["groups_dropped_stale"] == 0


def _rank_pid(pattern: str, rank: int) -> int:
    for pid in _pids(pattern):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    raise AssertionError(f"no rank {rank} process for {pattern!r}")


def test_killing_one_of_two_ranks_stops_the_run_with_a_clear_error_within_the_timeout(
    tmp_path: Path, demo_model: Path
) -> None:
    out = tmp_path / "run"
    timeout_s = 20
    proc = _start(
        out,
        demo_model,
        10_000,
        "--set",
        "trainer.distributed.world_size=2",
        "--set",
        f"trainer.distributed.collective_timeout_s={timeout_s}",
    )
    _wait_for_step(out, 3, proc)

    os.kill(_rank_pid(f"serve trainer {out}", 1), signal.SIGKILL)
    t0 = time.monotonic()
    output = _finish(proc, timeout=timeout_s + 60)
    elapsed = time.monotonic() - t0

    assert proc.returncode == 1
    assert "service trainer died" in output
    assert elapsed < timeout_s + 30  # never a hang: within the collective timeout (plus shutdown)
    log = (out / "logs" / "trainer.log").read_text()
    assert "rank" in log and ("Signals.SIGKILL" in log or "exitcode" in log or "CollectiveTimeout" in log)
    print(f"rank killed: run stopped after {elapsed:.1f}s")


def test_redis_killed_mid_run_loses_no_acknowledged_group_and_the_run_completes(
    tmp_path: Path, demo_model: Path
) -> None:
    import yaml

    out = tmp_path / "run"
    proc = _start(out, demo_model, 30)
    _wait_for_step(out, 8, proc)
    port = int(yaml.safe_load((out / "config.yaml").read_text())["redis"]["url"].rsplit(":", 1)[1].split("/")[0])
    _kill9(f"redis-server 127.0.0.1:{port}")
    trainer_log = out / "logs" / "trainer.log"
    wait_for(lambda: "redis unavailable" in trainer_log.read_text(), "the trainer seeing the outage", 60, alive=proc)

    redis = RedisServer("redis-server", port, out / "redis")  # same port, same AOF
    redis.start()
    try:
        output = _finish(proc, timeout=400)
        assert proc.returncode == 0, output[-3000:]
        summary = _check_books(out, 30)
    finally:
        redis.stop()
    print("redis kill -9:", summary)


@pytest.mark.parametrize("ranks", [1, 2])
def test_ctrl_c_mid_run_stops_the_trainer_gracefully_and_the_resume_trains_no_step_again(
    tmp_path: Path, demo_model: Path, ranks: int
) -> None:
    """Hold under attack, finding 5: Ctrl-C used to cancel the trainer without a checkpoint (and a step longer than
    15 s was SIGKILLed), so a resume trained every step since the last periodic checkpoint again. Now the trainer
    stops at its next micro-batch boundary with a final checkpoint of its last step, acknowledged."""
    out = tmp_path / "run"
    # 8 micro-batches per step (per rank: 8 / ranks); with 2 ranks every rank agrees on the stop before each one
    small = ["--set", f"trainer.micro_batch_size={16 // ranks}", "--set", f"trainer.distributed.world_size={ranks}"]
    proc = _start(out, demo_model, 30, *small)
    _wait_for_step(out, 7, proc)  # past the periodic checkpoint of step 5

    proc.send_signal(signal.SIGINT)
    first = _finish(proc)
    last = max(r["step"] for r in _rows(out) if r.get("phase", "rl") == "rl")
    resumed = _start(out, demo_model, 30, "--resume", "auto", *small)
    second = _finish(resumed)

    assert proc.returncode == 130 and resumed.returncode == 0, second[-3000:]
    groups: list[str] = []
    for path in sorted((out / "trained").glob("rank*.jsonl")):  # each rank's own record of what it trained
        records = [json.loads(line) for line in path.read_text().splitlines()]
        incarnations = list(dict.fromkeys(r["incarnation"] for r in records))
        assert len(incarnations) == 2
        # the resume starts at the last step trained before the stop: none trained again
        assert {r["resumed_from_step"] for r in records if r["incarnation"] == incarnations[1]} == {last}
        assert max(r["step"] for r in records if r["incarnation"] == incarnations[0]) == last
        groups += [g for r in records for g, _ in r["groups"]]
    assert len(groups) == len(set(groups)) == 30 * 8  # every group trained once, none lost
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups_trained"] == 30 * 8 and summary["groups_invalid"] == 0
    assert summary["groups_produced"] == (
        summary["groups_trained"]
        + summary["groups_dropped_stale"]
        + summary["groups_invalid"]
        + summary["groups_pending"]
    )
    # a final checkpoint of the last step: written at the stop, or the periodic one when the stop came at its step
    log = (out / "logs" / "trainer.log").read_text()
    assert (
        f"stopped at step {last} with a final checkpoint" in log
        or f"stopped at step {last}: the checkpoint of step {last} already holds every trained step" in log
    ), log[-3000:]
    assert "killing it" not in first and "for the trainer to stop gracefully" in first, first[-3000:]
