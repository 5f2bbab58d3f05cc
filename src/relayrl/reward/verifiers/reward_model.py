"""`reward_model`: a sequence-classification model with one scalar output (a Bradley-Terry reward model such as
Skywork-Reward or a `trl` RewardTrainer checkpoint) scores each prompt and completion; the chunk is scored as one
padded batch.

The text the model reads is the conversation ``user: prompt``, ``assistant: completion`` through its tokenizer's
chat template when it has one, else ``prompt`` and ``completion`` joined by a newline; it is truncated to
``max_length`` tokens from the left (the completion's end is what the reward judges). The score is the model's
logit, or its sigmoid with ``normalize: sigmoid``. The model loads once per verifier process, on the CPU unless
``device`` says otherwise; a model without exactly one output is refused.
"""

from __future__ import annotations

import functools
from typing import Any

from relayrl.reward.api import RewardInput, batched

NORMALIZE = ("none", "sigmoid")


class RewardModelError(RuntimeError):
    """The configured model cannot score: not found, not a classifier, or not one output."""


@functools.lru_cache(maxsize=2)
def _load(path: str, device: str, dtype: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as exc:
        raise RewardModelError(f"cannot load a sequence-classification model from {path}: {exc}") from None
    if model.config.num_labels != 1:
        raise RewardModelError(f"{path} has {model.config.num_labels} outputs; a reward model has one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.truncation_side = "left"
    return tokenizer, model.to(torch.device(device)).eval()


def _text(tokenizer: Any, inp: RewardInput) -> str:
    if getattr(tokenizer, "chat_template", None):
        turns = [{"role": "user", "content": inp.prompt}, {"role": "assistant", "content": inp.completion}]
        return str(tokenizer.apply_chat_template(turns, tokenize=False))
    return f"{inp.prompt}\n{inp.completion}"


@batched
def reward_model(
    inputs: list[RewardInput],
    *,
    model: str,
    max_length: int = 1024,
    normalize: str = "none",
    device: str = "cpu",
    dtype: str = "float32",
) -> list[float]:
    """The reward model's score of each input, computed as one batch."""
    import torch

    if normalize not in NORMALIZE:
        raise RewardModelError(f"normalize must be one of {NORMALIZE}, not {normalize!r}")
    tokenizer, net = _load(model, device, dtype)
    batch = tokenizer(
        [_text(tokenizer, inp) for inp in inputs],
        padding=True,
        truncation=True,
        max_length=max_length,
        add_special_tokens=not getattr(tokenizer, "chat_template", None),
        return_tensors="pt",
    ).to(net.device)
    with torch.inference_mode():
        logits = net(**batch).logits[:, 0].float()
    scores = torch.sigmoid(logits) if normalize == "sigmoid" else logits
    return [float(v) for v in scores.cpu().tolist()]
