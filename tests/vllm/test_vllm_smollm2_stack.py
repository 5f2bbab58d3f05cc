"""The packaged SmolLM2-135M-Instruct through the whole stack on the vLLM backend (`relayrl run` with
``inference.engine: vllm``): the few-step run of tests/smollm2_stack.py, as the native engine's
tests/e2e/test_smollm2_stack.py (chat-template prompts, generation, reward, LoRA steps, adapter-only publication
verified by the probe on vLLM, tokens stamped with versions, the accounting identity, a checkpoint that loads with
transformers + peft). The services run in this environment's interpreter (.venv-vllm)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relayrl.common.probe import PROBE_TOLERANCE
from tests.smollm2_stack import check_few_step_run, run_few_steps

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("peft")

# 8 sequences in flight (2 groups of 4) plus the probe; a 512-token context keeps vLLM's plan small on the CPU
VLLM = {"engine": "vllm", "max_batch_sequences": 16, "vllm": {"max_model_len": 512}}


def test_smollm2_trains_a_lora_adapter_through_the_stack_on_vllm(smollm2: Path, tmp_path: Path) -> None:
    proc, out = run_few_steps(smollm2, tmp_path, inference=VLLM)

    # peft's float32 forward against vLLM's CPU LoRA kernels: reduction order only, float32's probe tolerance
    check_few_step_run(proc, out, smollm2, probe_tolerance=PROBE_TOLERANCE[torch.float32])
