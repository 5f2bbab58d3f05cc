"""bench/gpu/check.sh, the GPU checks prepared for a machine with a GPU, checked where there is none: its steps fit
the 10 minutes docs/gpu.md promises and match that page's table, every file and command they name exists, it
refuses to run without CUDA, and its FSDP2 check computes the unsharded gradients (over gloo on the CPU)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relayrl.cli import parser as cli_parser
from relayrl.config import load_run_config
from relayrl.tasks.tiny_model import TinyModelConfig
from tests.conftest import REPO

SCRIPT = REPO / "bench" / "gpu" / "check.sh"
STEP = re.compile(r"^\s*run ([a-z0-9-]+) (\d+) ", re.M)


def _steps() -> dict[str, int]:
    steps: dict[str, int] = {}
    for name, limit in STEP.findall(SCRIPT.read_text()):
        steps[name] = max(steps.get(name, 0), int(limit))  # a step with a fallback branch counts its longer limit
    return steps


def test_check_steps_fit_in_ten_minutes_and_match_the_gpu_page() -> None:
    steps = _steps()
    assert sum(steps.values()) <= 600, steps
    page = (REPO / "docs" / "gpu.md").read_text()
    documented = dict(re.findall(r"^\| `([a-z0-9-]+)` \| .* \| (\d+) s \|$", page, re.M))
    assert {k: int(v) for k, v in documented.items()} == steps


def _joined() -> str:
    """The script's commands, continuation lines joined, comments left out."""
    lines = [line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#")]
    return "\n".join(lines).replace("\\\n", " ")


def test_check_names_only_files_that_exist() -> None:
    paths = set(re.findall(r"\b((?:tests|bench|examples)/[\w/.-]+)", _joined()))
    assert paths, "the script names no repository path"
    missing = [p for p in sorted(paths) if not (REPO / p.rstrip(".")).exists()]
    assert not missing, missing


def test_check_relayrl_commands_parse_and_their_overrides_exist() -> None:
    commands = [shlex.split(m) for m in re.findall(r"\brelayrl ((?:init-model|run|import-model) [^&;\n]*)", _joined())]
    assert {c[0] for c in commands} == {"init-model", "run", "import-model"}
    for words in commands:
        args = cli_parser().parse_args([w.replace("$MODELS", "/tmp/m").replace("$OUT", "/tmp/o") for w in words])
        sets = [s.split("=", 1) for s in (getattr(args, "set", None) or [])]
        if words[0] == "init-model":
            fields = set(TinyModelConfig.__dataclass_fields__)
            assert {k for k, _ in sets} <= fields
        elif words[0] == "run":
            load_run_config(REPO / args.config, [f"{k}={v}" for k, v in sets])  # an unknown key or bad value raises


def test_the_1b_model_of_the_check_has_at_least_a_billion_parameters() -> None:
    sets = dict(s.split("=") for s in re.findall(r"--set (\w+=\d+)", _joined().split("publish-1b", 1)[1]))
    cfg = TinyModelConfig(**{k: int(v) for k, v in sets.items() if k != "max_position_embeddings"})
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    kv = h * cfg.num_kv_heads // cfg.num_heads
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i  # q and o, k and v (grouped), gate, up and down
    assert layers * per_layer >= 1_000_000_000


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_check_without_cuda_stops_before_any_step(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--python", sys.executable, "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "torch sees no CUDA device" in proc.stdout
    assert not (tmp_path / "summary.md").exists()


@pytest.mark.distributed
def test_fsdp_check_on_two_gloo_ranks_agrees_with_one_process() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/gpu/fsdp_check.py", "--device", "cpu", "--world", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["agree"] is True and len(report["ranks"]) == 2
