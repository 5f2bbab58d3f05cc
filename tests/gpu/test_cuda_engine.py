"""The native engine and the learner on CUDA agree with the CPU (run where a GPU exists)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relayrl.common.model import load_model, load_tokenizer
from relayrl.config.model import ModelConfig
from relayrl.inference.engine import GenerationInput, generate
from relayrl.inference.native import NativeEngine

pytestmark = pytest.mark.gpu


def test_cuda_engine_logprobs_match_a_cpu_forward_of_the_same_samples(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    gpu_engine = NativeEngine(
        load_model(ModelConfig(path=tiny_model_dir, device="cuda")), tokenizer, torch.device("cuda")
    )
    cpu_model = load_model(ModelConfig(path=tiny_model_dir))

    [samples] = generate(gpu_engine, [GenerationInput(prompt_ids=[3, 4, 5], n=8, max_new_tokens=6)])

    for s in samples:
        ids = torch.tensor([[3, 4, 5, *s.token_ids]])
        with torch.no_grad():
            logits = cpu_model(input_ids=ids).logits[0, 2:-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids).unsqueeze(1)).squeeze(1)
        # float32 on two devices: TF32 matmuls may be enabled on CUDA, so allow 1e-3
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, rtol=1e-3, atol=1e-3)
