"""The thread budget: the launcher's automatic division, the children's environment, the service applying it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relayrl.common.threads import apply_threads, automatic_cpus, automatic_division, pin_cpus, thread_env
from relayrl.config import load_run_config
from relayrl.config.threads import ThreadsConfig, TrainerThreadsConfig
from relayrl.config.typed import ConfigError


@pytest.mark.parametrize(
    ("cores", "ranks", "inference", "trainer"),
    [(1, 1, 1, 1), (2, 1, 1, 1), (8, 1, 4, 4), (7, 1, 3, 4), (8, 2, 4, 2), (2, 2, 1, 1)],
)
def test_automatic_division_gives_inference_half_and_each_trainer_rank_a_share_of_the_rest(
    cores: int, ranks: int, inference: int, trainer: int
) -> None:
    division = automatic_division(cores, ranks)
    assert division == {"inference": inference, "trainer": trainer, "reward": 1, "rollout": 1}


def test_launcher_resolves_automatic_counts_and_keeps_the_ones_set() -> None:
    from relayrl.launcher import with_thread_budget

    cfg = load_run_config(None, ["trainer.threads.intra_op=3"])

    resolved = with_thread_budget(cfg, cores=range(8))

    assert resolved.inference.threads == ThreadsConfig(intra_op=4, interop=1)
    # a count set: nothing is pinned, nothing borrowed
    assert resolved.trainer.threads == TrainerThreadsConfig(intra_op=3, interop=1)
    assert resolved.reward.threads.intra_op == resolved.rollout.threads.intra_op == 1
    assert thread_env(3) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"} and thread_env(0) == {}


@pytest.mark.parametrize(
    ("cores", "ranks", "generation", "training"),
    [([0, 1], 1, [0], [1]), ([4, 2, 6, 3], 1, [2, 3], [4, 6]), (range(8), 2, [0, 1, 2, 3], [4, 5, 6, 7])],
)
def test_automatic_cpus_put_the_trainer_on_the_cores_of_its_threads_and_the_other_services_on_the_rest(
    cores: list[int], ranks: int, generation: list[int], training: list[int]
) -> None:
    cpus = automatic_cpus(cores, ranks)

    assert cpus == {"inference": generation, "reward": generation, "rollout": generation, "trainer": training}
    assert len(training) >= automatic_division(len(generation) + len(training), ranks)["trainer"] * ranks


def test_automatic_cpus_on_one_core_pin_nothing() -> None:
    assert automatic_cpus([3]) == {"inference": [], "trainer": [], "reward": [], "rollout": []}


def test_launcher_pins_the_services_only_when_it_divides_the_cores_itself() -> None:
    from relayrl.launcher import with_thread_budget

    divided = with_thread_budget(load_run_config(None, []), cores=[0, 1])
    set_count = with_thread_budget(load_run_config(None, ["trainer.threads.intra_op=2"]), cores=[0, 1])
    set_cpus = with_thread_budget(load_run_config(None, ["reward.threads.cpus=[1]"]), cores=[0, 1])

    assert [divided.inference.threads.cpus, divided.trainer.threads.cpus] == [[0], [1]]
    assert divided.reward.threads.cpus == divided.rollout.threads.cpus == [0]
    assert all(not getattr(set_count, n).threads.cpus for n in ("inference", "trainer", "reward", "rollout"))
    assert [set_cpus.reward.threads.cpus, set_cpus.trainer.threads.cpus, set_cpus.inference.threads.cpus] == [
        [1],
        [],
        [],
    ]  # the user's own pinning, nothing added


def test_threads_config_refuses_a_repeated_or_negative_cpu() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.threads\.cpus = \[0, 0\]: must not repeat"):
        load_run_config(None, ["trainer.threads.cpus=[0, 0]"])
    with pytest.raises(ConfigError, match=r"inference\.threads\.cpus\[0\] = -1"):
        load_run_config(None, ["inference.threads.cpus=[-1]"])


def test_pin_refuses_a_cpu_the_process_may_not_use_naming_the_field() -> None:
    absent = max(os.sched_getaffinity(0)) + 1

    with pytest.raises(ConfigError, match=rf"trainer\.threads\.cpus = \[{absent}\]: must be CPUs this process"):
        pin_cpus([absent], "trainer.threads.cpus")


def test_a_pinned_service_runs_every_thread_it_had_and_starts_on_its_cpus() -> None:
    # a fresh process: pinning this one would pin the test run; a thread started before the pin must move too
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import json, os, threading\n"
        "from relayrl.common.threads import apply_threads\n"
        "from relayrl.config.threads import ThreadsConfig\n"
        "ready, stop, seen = threading.Event(), threading.Event(), {}\n"
        "def early():\n"
        "    ready.set(); stop.wait(); seen['early'] = sorted(os.sched_getaffinity(0))\n"
        "t = threading.Thread(target=early); t.start(); ready.wait()\n"
        f"apply_threads(ThreadsConfig(cpus=[{cpu}]), 'trainer')\n"
        "stop.set(); t.join()\n"
        "late = threading.Thread(target=lambda: seen.update(late=sorted(os.sched_getaffinity(0))))\n"
        "late.start(); late.join()\n"
        "child = os.popen('grep Cpus_allowed_list /proc/self/status').read().split()[-1]\n"
        "print(json.dumps([sorted(os.sched_getaffinity(0)), seen['early'], seen['late'], child]))\n"
    )

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)

    main, early, late, child = json.loads(out.stdout)
    assert main == early == late == [cpu]
    assert child == str(cpu)


def test_apply_sets_torch_intra_op_threads_logs_them_and_zero_keeps_torchs_choice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="relayrl.common.threads"):
            assert apply_threads(ThreadsConfig(intra_op=1), "trainer") == (1, torch.get_num_interop_threads())
        assert torch.get_num_threads() == 1
        assert "trainer threads: intra-op 1, inter-op" in caplog.text
        assert apply_threads(ThreadsConfig(), "trainer") == (1, torch.get_num_interop_threads())
    finally:
        torch.set_num_threads(before)


def test_a_fresh_process_started_with_the_launchers_environment_runs_the_budget() -> None:
    # inter-op threads can be set once per process, before inter-op work: only a fresh process shows it
    code = (
        "import json, os, torch\n"
        "from relayrl.common.threads import apply_threads\n"
        "from relayrl.config.threads import ThreadsConfig\n"
        "print(json.dumps([torch.get_num_threads(), apply_threads(ThreadsConfig(2, 3), 'inference')]))\n"
    )
    env = {"PATH": "/usr/bin:/bin", **thread_env(2)}

    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)

    at_import, applied = json.loads(out.stdout)
    assert at_import == 2  # OMP_NUM_THREADS held from import
    assert applied == [2, 3]


def test_the_launcher_gives_each_child_its_threads_in_the_environment(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path
) -> None:
    from relayrl.launcher import Launcher

    cfg = load_run_config(
        None, [f"model.path={tiny_model_dir}", f"rollout.dataset={dataset_path}", "inference.threads.intra_op=3"]
    )
    launcher = Launcher(cfg, tmp_path / "run")
    (tmp_path / "run" / "logs").mkdir(parents=True)
    config_path = tmp_path / "run" / "config.yaml"
    config_path.write_text("{}\n")

    launcher._start_child("inference", config_path)
    child = launcher.children["inference"]
    try:
        environ = Path(f"/proc/{child.proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        child.proc.kill()
        child.proc.wait()
        child.log_file.close()

    assert b"OMP_NUM_THREADS=3" in environ and b"MKL_NUM_THREADS=3" in environ
