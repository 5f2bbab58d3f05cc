"""The trainer's log-probabilities by chunks (trainer.logprob_chunk_positions > 0) against full logits: the same
values and gradients, and never a [rows, length, vocab] tensor (the memory of the full fine-tuning OOM)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from relayrl.common.lora import with_lora
from relayrl.common.model import load_model
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.lora import LoraConfig
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import TrainerConfig
from relayrl.trainer.batching import PackedBatch, model_logprobs, pack, pack_row
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner
from tests.synthetic import varied_episodes

VOCAB = 1000
HIDDEN = 32
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
COMPLETIONS = [[20, 21, 22], [30, 31, 32, 33, 34, 35, 36], [40, 41]]
MASKS = [[1, 1, 1], [1, 1, 0, 0, 1, 1, 1], [1, 1]]  # a tool output (mask 0) inside the second completion
TEMPERATURES = [1.0, 0.7, 1.3]


def _model(dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).to(dtype)


def _batch(packed: bool) -> PackedBatch:
    behaviour = [[-1.0] * len(c) for c in COMPLETIONS]
    if packed:
        return pack_row(PROMPTS, COMPLETIONS, behaviour, MASKS, TEMPERATURES, torch.device("cpu"))
    return pack(PROMPTS, COMPLETIONS, behaviour, MASKS, TEMPERATURES, 0, torch.device("cpu"))


def _logprobs_and_grads(mb: PackedBatch, chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _model()
    logp = model_logprobs(model, mb, chunk)
    weights = torch.linspace(-1.0, 2.0, logp.numel()).reshape(logp.shape)  # a loss that weighs tokens unequally
    (logp * weights * mb.mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("chunk", [1, 4, 256])
def test_chunked_logprobs_equal_full_logits_values_and_gradients(packed: bool, chunk: int) -> None:
    mb = _batch(packed)

    full, full_grads = _logprobs_and_grads(mb, 0)
    chunked, chunked_grads = _logprobs_and_grads(mb, chunk)

    keep = mb.mask != 0
    # same float32 formula (x - logsumexp), reduced in another order: a few ulps apart
    torch.testing.assert_close(chunked[keep], full[keep], rtol=1e-5, atol=1e-6)
    # positions left out carry the behaviour logprob, so ratios there are exactly 1
    assert torch.equal(chunked[~keep], mb.behaviour_logprobs[~keep])
    assert full_grads.keys() == chunked_grads.keys()
    for name, grad in full_grads.items():
        # softmax recomputed per chunk and the output layer's matmul over N rows instead of B x L (zeros
        # included): float32 sums in another order
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_logprobs_through_a_lora_adapter_equal_full_logits() -> None:
    mb = _batch(packed=False)
    model = with_lora(_model(), LoraConfig(enabled=True, rank=4))  # the hook reaches the head through peft

    full = model_logprobs(model, mb, 0).detach()
    chunked = model_logprobs(model, mb, 4)
    (chunked * mb.mask).sum().backward()

    keep = mb.mask != 0
    # same float32 formula reduced in another order (see above)
    torch.testing.assert_close(chunked.detach()[keep], full[keep], rtol=1e-5, atol=1e-6)
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters() if p.requires_grad)


class _VocabTensors(TorchDispatchMode):
    """Records the rows (numel / vocab) of every op output whose last dimension is the vocabulary, by dtype (not
    the output layer's weight, transposed, nor its gradient: [hidden, vocab])."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(t, torch.Tensor)
                and t.dim() >= 2
                and t.shape[-1] == VOCAB
                and t.is_floating_point()
                and tuple(t.shape) != (HIDDEN, VOCAB)
            ):
                self.rows[t.dtype] = max(self.rows.get(t.dtype, 0), t.numel() // VOCAB)
        return out


def _vocab_rows(dtype: torch.dtype, chunk: int) -> tuple[dict[torch.dtype, int], PackedBatch]:
    model, mb = _model(dtype), _batch(packed=False)
    with _VocabTensors() as seen:
        logp = model_logprobs(model, mb, chunk)
        (logp * mb.mask).sum().backward()
    return seen.rows, mb


def test_full_logits_hold_every_position_at_once() -> None:
    """The measurement below can fail: the plain way holds [B, L, V] float32 tensors."""
    rows, mb = _vocab_rows(torch.float32, 0)

    assert rows[torch.float32] == mb.targets.numel()


def test_chunked_logprobs_never_hold_all_positions_of_the_vocabulary() -> None:
    chunk = 4
    rows, mb = _vocab_rows(torch.bfloat16, chunk)

    trained = int((mb.mask != 0).sum())
    assert trained < mb.targets.numel()  # the batch has prompt and padding positions to leave out
    # bfloat16 logits (and their gradient) of the trained positions only; float32 one chunk at a time
    assert rows[torch.bfloat16] == trained
    assert rows[torch.float32] <= chunk


def _episodes() -> list[Episode]:
    eps = varied_episodes(12)
    assert len(eps[4].completion_token_ids) == 7
    eps[4].loss_mask[:] = [1, 0, 0, 1, 1, 1, 1]  # tool output tokens inside the completion, left out
    return eps


def test_learner_step_with_chunked_logprobs_has_the_full_logits_loss_and_gradients(tiny_model_dir: Path) -> None:
    results = []
    for chunk in (0, 3):
        torch.manual_seed(0)
        model = load_model(ModelConfig(path=tiny_model_dir))
        learner = Learner(
            model,
            TrainerConfig(micro_batch_size=5, logprob_chunk_positions=chunk),
            0,
            torch.device("cpu"),
            max_completion_tokens=7,
        )
        stats = learner.rl_gradients(StepBatch.of(_episodes()))
        results.append((stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (full, full_grads), (chunked, chunked_grads) = results

    # statistics are float64 sums of float32 per-token values computed in another order
    assert chunked.loss == pytest.approx(full.loss, rel=1e-5, abs=1e-7)
    assert chunked.tokens == full.tokens
    assert chunked.logprob_diff_mean == pytest.approx(full.logprob_diff_mean, rel=1e-5, abs=1e-7)
    for name, grad in full_grads.items():
        # float32 gradients, the same sums in another order (see above)
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
