"""lm-eval (the `eval-harness` extra) against relayrl's OpenAI-compatible API agrees with lm-eval on the Hugging
Face model itself: the tasks of tests/integration/lm_eval_tasks (local JSONL, nothing downloaded) run once through
the ``local-completions`` model type exactly as docs/clients.md shows the command, and once through lm-eval's
``hf`` model on the same model directory.

Tolerance: logprob sums agree within atol 1e-4 + rtol 1e-5. Both sides run the same float32 model on the CPU and
take the same log-softmax; they differ only in float32 rounding (relayrl's prefill shapes and padding are not
lm-eval's, and its logprobs travel as JSON), measured at up to 3e-7 on sums of a few tokens of about -6. Accuracy
and greedy generations must be identical."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.eval_model import create_eval_model
from tests.integration.helpers import inference_server

pytestmark = [pytest.mark.integration, pytest.mark.slow(seconds=40)]

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = ["relayrl_arith_choice", "relayrl_arith_gen"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
RTOL, ATOL = 1e-5, 1e-4  # float32 rounding between two runs of one float32 model (see the module docstring)


def documented_command() -> str:
    """The lm-eval command of docs/clients.md (its only ``shell`` block that starts with lm_eval)."""
    [command] = re.findall(
        r"^```shell\n(lm_eval .*?)^```", (REPO / "docs" / "clients.md").read_text(), flags=re.DOTALL | re.MULTILINE
    )
    return command


def _samples(out: Path, task: str) -> list[dict[str, Any]]:
    [path] = out.rglob(f"samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["doc_id"])


def _pairs(sample: dict[str, Any]) -> tuple[list[float], list[bool]]:
    """A multiple-choice sample's (logprob sum, is_greedy) of each choice (the samples file holds them as text)."""
    pairs = [r[0] for r in sample["resps"]]
    return [float(p[0]) for p in pairs], [p[1] in (True, "True") for p in pairs]


def _metrics(out: Path) -> dict[str, Any]:
    [path] = out.rglob("results_*.json")
    return json.loads(path.read_text())["results"]  # type: ignore[no-any-return]


async def _run_documented(model_dir: Path, out: Path) -> tuple[int, str]:
    async with inference_server(model_dir, http=True) as (_, service):
        env = {
            **os.environ,
            **OFFLINE,
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "RELAYRL_INFERENCE_HTTP": f"http://127.0.0.1:{service.http_port}",  # type: ignore[attr-defined]
            "RELAYRL_MODEL": service.model_name,
            "RELAYRL_MODEL_DIR": str(model_dir),
            "EVAL_OUT": str(out),
        }
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-euo",
            "pipefail",
            "-c",
            documented_command(),
            cwd=REPO,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        stdout, _ = await asyncio.wait_for(proc.communicate(), timeout=400)
        return int(proc.returncode or 0), stdout.decode(errors="replace")


def _run_hf(model_dir: Path) -> dict[str, Any]:
    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        return simple_evaluate(  # type: ignore[no-any-return]
            model="hf",
            model_args={"pretrained": str(model_dir), "dtype": "float32", "device": "cpu", "max_length": 256},
            tasks=TASKS,
            task_manager=TaskManager(include_path=str(TASKS_DIR)),
            log_samples=True,
            batch_size=1,
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Path]]:
    """(lm-eval's result on the Hugging Face model, the output folder of the documented command against relayrl)."""
    pytest.importorskip("lm_eval", reason="the eval-harness extra (make test installs it)")
    model_dir = create_eval_model(tmp_path_factory.mktemp("models") / "evalmodel")
    out = tmp_path_factory.mktemp("lm_eval")
    rc, log = asyncio.run(_run_documented(model_dir, out))
    assert rc == 0, log[-4000:]
    yield _run_hf(model_dir), out


def test_loglikelihood_task_through_the_api_agrees_with_hugging_face(runs: tuple[dict[str, Any], Path]) -> None:
    hf, out = runs
    task = "relayrl_arith_choice"
    api_samples, hf_samples = _samples(out, task), hf["samples"][task]
    assert len(api_samples) == len(hf_samples) == 12

    for a, h in zip(api_samples, sorted(hf_samples, key=lambda r: r["doc_id"]), strict=True):
        api_lls, api_greedy = _pairs(a)
        hf_lls, hf_greedy = _pairs(h)
        assert all(math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL) for x, y in zip(api_lls, hf_lls, strict=True)), (
            a["doc_id"],
            api_lls,
            hf_lls,
        )
        assert api_greedy == hf_greedy
        assert a["acc"] == h["acc"] and a["acc_norm"] == h["acc_norm"]
    api_metrics, hf_metrics = _metrics(out)[task], hf["results"][task]
    assert api_metrics["acc,none"] == hf_metrics["acc,none"]
    assert api_metrics["acc_norm,none"] == hf_metrics["acc_norm,none"]
    assert len({round(ll, 3) for s in api_samples for ll in _pairs(s)[0]}) > 12  # the choices' scores differ


def test_greedy_generation_task_through_the_api_matches_hugging_face(runs: tuple[dict[str, Any], Path]) -> None:
    hf, out = runs
    task = "relayrl_arith_gen"
    api_samples = _samples(out, task)
    hf_samples = sorted(hf["samples"][task], key=lambda r: r["doc_id"])
    api_texts = [s["resps"][0][0] for s in api_samples]
    hf_texts = [s["resps"][0][0] for s in hf_samples]

    assert api_texts == hf_texts
    assert len(set(api_texts)) >= 6  # the prompts get different answers: the comparison can fail
    assert not any(" " in t for t in api_texts)  # the stop string (" ") ends an answer and is not part of it
    assert [s["exact_match"] for s in api_samples] == [s["exact_match"] for s in hf_samples]
    assert _metrics(out)[task]["exact_match,none"] == hf["results"][task]["exact_match,none"]
