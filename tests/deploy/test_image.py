"""The Dockerfile runs the services as an unprivileged user and fails its build when the reward sandbox's parts
are missing. No Docker engine here: the build-time check is taken from the Dockerfile (joined as Docker joins
continuation lines) and run in this environment, which installs relayrl the same way (`pip install .`)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib

import yaml

from tests.conftest import REPO

DOCKERFILE = REPO / "Dockerfile"


def _runtime_stage() -> str:
    text = DOCKERFILE.read_text().replace("\\\n", "")  # Docker's line continuations
    return text[text.index(" AS runtime") :]


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
    code = (
        "import relayrl.reward.bwrap as m; m.packaged_bwrap = lambda: None; import os; "
        "os.environ['PATH'] = '/nonexistent'; " + _sandbox_check()
    )

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    assert result.returncode != 0 and "no bwrap" in result.stderr


# -- layers, extras, init process, labels; compose and chart on the same images -------------------------------------


def _builder_stage() -> str:
    text = DOCKERFILE.read_text().replace("\\\n", "")
    return text[text.index(" AS builder") : text.index(" AS runtime")]


def test_dependencies_are_installed_in_a_layer_before_the_code_is_copied() -> None:
    stage = _builder_stage()
    deps = stage.index("pip install -r /tmp/requirements.txt")
    assert stage.index("COPY pyproject.toml") < deps < stage.index("COPY src")
    assert "pip install --no-deps ." in stage[stage.index("COPY src") :]  # the code layer installs nothing else
    assert re.search(r"^ARG EXTRAS=", stage, flags=re.M) and '"${EXTRAS}"' in stage


def _requirements(extras: str, variant: str = "cpu") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "image_requirements.py"), extras, variant],
        input=(REPO / "pyproject.toml").read_text(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_dependency_layer_installs_exactly_the_projects_requirements_and_the_chosen_extras() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plain = _requirements("")
    with_wandb = _requirements("wandb")
    unknown = _requirements("nonexistent")

    assert plain.returncode == 0 and plain.stdout.splitlines() == project["dependencies"]
    assert with_wandb.stdout.splitlines() == [*project["dependencies"], *project["optional-dependencies"]["wandb"]]
    assert unknown.returncode != 0 and "unknown extras ['nonexistent']" in unknown.stderr


def test_tini_is_pid_one_and_the_image_carries_oci_labels() -> None:
    stage = _runtime_stage()
    assert re.search(r"^ENTRYPOINT \[\"tini\", \"--\", \"relayrl\"\]$", stage, flags=re.M)
    assert stage.index("install -y --no-install-recommends tini") < stage.index("USER relayrl")
    labels = dict(re.findall(r"(org\.opencontainers\.image\.[a-z]+)=\"([^\"]*)\"", stage))
    license_ = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"]
    assert labels["org.opencontainers.image.licenses"] == license_
    assert {"title", "version", "revision", "source", "description"} <= {k.rsplit(".", 1)[1] for k in labels}


def _compose_image(service: dict[str, object]) -> str:
    image = str(service["image"])
    default = re.fullmatch(r"\$\{[A-Z_]+:-([^}]+)\}", image)  # ${RELAYRL_IMAGE:-relayrl:0.1.0}
    return default.group(1) if default else image


def test_compose_and_the_chart_run_the_same_relayrl_and_redis_images() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "relayrl" / "Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts" / "relayrl" / "values.yaml").read_text())
    relayrl = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    redis = values["redis"]["image"]

    assert _compose_image(compose["x-relayrl"]) == relayrl
    assert _compose_image(compose["services"]["redis"]) == f"{redis['repository']}:{redis['tag']}"
    assert redis["tag"] != "7.2.5-alpine"  # published CVEs (see values.yaml)


def test_a_cuda_13_image_gets_vllms_cuda_build_pinned_to_the_projects_torch_and_never_the_cpu_build() -> None:
    """PyPI's vllm 0.32.0 is built for CUDA 13 and requires torch==2.13.0 (the project's pin, which the cu130 wheel
    satisfies) and transformers>=5.16.1,<5.20 (inside the project's range): the pair resolves (pip --dry-run,
    docs/deploy.md). A CUDA 12 image gets no vLLM rather than a mismatched one."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    cuda13, cuda12 = _requirements("", "cu130"), _requirements("", "cu128")

    assert cuda13.returncode == 0 and "vllm==0.32.0" in cuda13.stdout.splitlines()
    assert "transformers>=5.16.1,<5.20" in cuda13.stdout.splitlines() and "torch==2.13.0" in project["dependencies"]
    assert cuda12.returncode == 0 and "vllm" not in cuda12.stdout and "use TORCH_VARIANT=cu130" in cuda12.stderr
    assert "vllm" not in _requirements("").stdout  # the CPU image: no vLLM unless asked for
    for extras, variant, why in (("vllm", "cu130", "CPU build"), ("vllm-cuda", "cu128", "built for CUDA 13")):
        refused = _requirements(extras, variant)
        assert refused.returncode != 0 and why in refused.stderr
    assert '"${EXTRAS}" "${TORCH_VARIANT}"' in _builder_stage()
