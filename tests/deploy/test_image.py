"""The Dockerfile runs the services as an unprivileged user and fails its build when the reward sandbox's parts
are missing. No Docker engine here: the build-time check is taken from the Dockerfile (joined as Docker joins
continuation lines) and run in this environment, which installs relayrl the same way (`pip install .`)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

from tests.conftest import REPO

DOCKERFILE = REPO / "Dockerfile"


def _runtime_stage() -> str:
    text = DOCKERFILE.read_text().replace("\\\n", "")  # Docker's line continuations
    return text[text.index(" AS runtime"):]


def _sandbox_check() -> str:
    (line,) = [ln for ln in _runtime_stage().splitlines() if ln.startswith("RUN ") and "find_bwrap" in ln]
    argv = shlex.split(line.removeprefix("RUN "))
    assert argv[:2] == ["python", "-c"] and len(argv) == 3, argv
    return argv[2]


def test_image_runs_services_as_a_non_root_user_set_before_the_sandbox_check() -> None:
    stage = _runtime_stage()
    users = re.findall(r"^USER (\S+)$", stage, flags=re.M)

    assert users == ["relayrl:relayrl"]
    assert "--uid 10001" in stage
    assert stage.index("USER relayrl") < stage.index("find_bwrap")  # checked as the user that runs the sandbox


def test_build_time_sandbox_check_finds_bwrap_prlimit_and_python() -> None:
    result = subprocess.run([sys.executable, "-c", _sandbox_check()], capture_output=True, text=True, timeout=60)

    assert result.returncode == 0, result.stderr
    assert "sandbox: bwrap /" in result.stdout and "| prlimit /usr/bin/prlimit" in result.stdout


def test_build_time_sandbox_check_fails_without_a_bwrap() -> None:
    # the same check where neither PATH nor the wheel has a bwrap: the image build must stop
    code = "import relayrl.reward.bwrap as m; m.packaged_bwrap = lambda: None; import os; " \
           "os.environ['PATH'] = '/nonexistent'; " + _sandbox_check()

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    assert result.returncode != 0 and "no bwrap" in result.stderr
