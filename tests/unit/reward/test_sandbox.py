"""The code sandbox used directly: environment, limits, cleanup, and refusing to run when it cannot isolate."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from relayrl.config.reward import SandboxBackend, SandboxConfig
from relayrl.reward.sandbox import PROBE_RETRY_S, Sandbox, SandboxUnavailable
from relayrl.reward.sandbox_exec import SandboxRun

BACKENDS = [SandboxBackend.BWRAP, SandboxBackend.PROCESS]


def _sandbox(backend: SandboxBackend, **overrides: object) -> Sandbox:
    return Sandbox(SandboxConfig(backend=backend, **overrides))  # type: ignore[arg-type]


@pytest.fixture
def made_dirs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The sandbox's own run directories (``relayrl-sbx-*``), as it creates them: whether they are removed is checked
    on these, not on the shared /tmp, where another test's sandbox run on the other xdist worker comes and goes (a CI
    run once saw one there before and another after)."""
    made: list[Path] = []
    real = tempfile.mkdtemp

    def mkdtemp(*args: Any, **kwargs: Any) -> str:
        path = real(*args, **kwargs)
        if Path(path).name.startswith("relayrl-sbx-"):
            made.append(Path(path))
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return made


@pytest.mark.parametrize("backend", BACKENDS)
def test_program_gets_a_scrubbed_environment_and_a_private_writable_directory(
    backend: SandboxBackend, monkeypatch: pytest.MonkeyPatch, made_dirs: list[Path]
) -> None:
    monkeypatch.setenv("RELAYRL_SECRET_TOKEN", "hunter2")
    program = (
        "import os\nopen('scratch.txt', 'w').write('x')\nprint(sorted(os.environ))\n"
        "print(os.getuid() != 0, os.path.exists('scratch.txt'))\nos.write(3, b'result')\n"
    )

    run = _sandbox(backend).run_python("main.py", {"main.py": program})

    assert run.ok, run.stderr
    lines = run.stdout.decode().splitlines()
    assert "RELAYRL_SECRET_TOKEN" not in lines[0] and "hunter2" not in run.stdout.decode()
    assert lines[1] == "True True"  # not root; its files land in its own directory
    assert run.channel == b"result"
    assert made_dirs and [d for d in made_dirs if d.exists()] == []  # the run's directories are removed


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_size_and_open_file_limits_apply(backend: SandboxBackend) -> None:
    program = (
        "import os\ntry:\n    open('big', 'wb').write(b'x' * (3 * 1024 * 1024))\n    print('wrote')\n"
        "except OSError as e:\n    print('fsize', e.errno)\nfiles = []\ntry:\n    for i in range(100):\n"
        "        files.append(open('f%d' % i, 'w'))\nexcept OSError as e:\n    print('nofile', len(files))\n"
    )

    run = _sandbox(backend, max_file_mb=1, max_open_files=16).run_python("main.py", {"main.py": program})

    lines = run.stdout.decode().splitlines()
    assert lines[0] == "fsize 27"  # EFBIG
    assert lines[1].startswith("nofile ") and int(lines[1].split()[1]) < 16


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_limit_stops_a_busy_program_before_the_wall_clock(backend: SandboxBackend) -> None:
    t0 = time.monotonic()

    run = _sandbox(backend, cpu_s=1, wall_timeout_s=30.0).run_python("main.py", {"main.py": "while True: pass"})

    assert run.exit_code is not None and run.exit_code < 0 and not run.timed_out  # SIGKILL/SIGXCPU from the kernel
    # 1 CPU second takes longer on a loaded 2-core machine (the program shares the cores, and the probe run and
    # interpreter start-up come first): 10 s holds there, and stays far from the 30 s wall clock
    assert time.monotonic() - t0 < 10.0


def test_missing_bubblewrap_means_no_run_at_all() -> None:
    sandbox = _sandbox(SandboxBackend.BWRAP, bwrap="/nonexistent/bwrap")

    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        sandbox.run_python("main.py", {"main.py": "print(1)"})


def test_a_failed_sandbox_probe_is_believed_for_a_while_then_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox = _sandbox(SandboxBackend.BWRAP)
    now = [100.0]
    sandbox.clock = lambda: now[0]
    real_run, probes = sandbox._run, []

    def first_probe_times_out(argv: list[str], *args: object, **kwargs: object) -> SandboxRun:
        if "print(6 * 7)" in argv:
            probes.append(now[0])
            if len(probes) == 1:  # a probe killed at its wall-clock limit, as on a machine under heavy load
                return SandboxRun(
                    exit_code=None,
                    stdout=b"",
                    stderr=b"",
                    channel=b"",
                    timed_out=True,
                    output_exceeded=False,
                    wall_s=10.0,
                )
        return real_run(argv, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sandbox, "_run", first_probe_times_out)

    with pytest.raises(SandboxUnavailable, match="wall-clock"):
        sandbox.run_python("main.py", {"main.py": "print(1)"})
    now[0] += PROBE_RETRY_S - 1
    with pytest.raises(SandboxUnavailable, match="wall-clock"):  # still within the retry interval: no new probe
        sandbox.run_python("main.py", {"main.py": "print(1)"})
    now[0] += 1
    run = sandbox.run_python("main.py", {"main.py": "print(1)"})
    sandbox.run_python("main.py", {"main.py": "print(2)"})

    assert run.ok and run.stdout == b"1\n"
    assert probes == [100.0, 100.0 + PROBE_RETRY_S]  # once failed, once retried; a success is kept


def test_file_names_must_stay_inside_the_source_directory() -> None:
    with pytest.raises(ValueError, match="plain names"):
        _sandbox(SandboxBackend.BWRAP).run_python("main.py", {"../main.py": "print(1)"})
