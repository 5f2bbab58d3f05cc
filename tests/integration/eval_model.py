"""A tiny character-level model whose greedy answers differ from prompt to prompt: the random demo model with its
weight matrices scaled up, so its logits are peaked (no near-ties between the two sides of a comparison) and
depend on the prompt (a random model at the usual scale answers every prompt alike). Built in a second, no
training: greedy decoding of 16 such sums gave 15 different answers, 6 of them with a space inside (the generation
task's stop string)."""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model

SCALE = 30.0  # logits grow about linearly with it; at 1 greedy answers are one repeated character


def create_eval_model(out: Path) -> Path:
    from transformers import LlamaForCausalLM

    create_tiny_model(out, TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, seed=1))
    model = LlamaForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(SCALE**0.5)
    model.save_pretrained(str(out))
    return out
