"""Create the tiny demo model: a randomly initialised Llama with a character-level tokenizer.

It is saved with ``save_pretrained`` and loaded back through the same path a real checkpoint takes. The
round trip of the tokenizer is checked, since transformers may substitute its own tokenizer class.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relayrl.common.model import quiet_transformers

log = logging.getLogger(__name__)

SPECIALS = ["<pad>", "<eos>", "<unk>"]
DEFAULT_CHARS = "0123456789+-*= "


@dataclass
class TinyModelConfig:
    chars: str = field(default=DEFAULT_CHARS, metadata={"help": "Characters of the vocabulary (one token each)."})
    hidden_size: int = field(default=128, metadata={"help": "Model width.", "ge": 8})
    intermediate_size: int = field(default=256, metadata={"help": "MLP width.", "ge": 8})
    num_layers: int = field(default=2, metadata={"help": "Decoder layers.", "ge": 1})
    num_heads: int = field(default=4, metadata={"help": "Attention heads.", "ge": 1})
    num_kv_heads: int = field(default=2, metadata={"help": "Key/value heads.", "ge": 1})
    max_position_embeddings: int = field(default=256, metadata={"help": "Context length.", "ge": 8})
    tie_word_embeddings: bool = field(default=True, metadata={"help": "Share input and output embeddings."})
    seed: int = field(default=0, metadata={"help": "Initialisation seed."})


def build_tokenizer(chars: str):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    unique = list(dict.fromkeys(chars))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + unique)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def create_tiny_model(out_dir: Path, cfg: TinyModelConfig | None = None) -> Path:
    """Create, save and verify the demo model in ``out_dir``; returns ``out_dir``."""
    quiet_transformers()
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = cfg or TinyModelConfig()
    tokenizer = build_tokenizer(cfg.chars)
    vocab_size = len(tokenizer)
    model_cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(model_cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    probe = "".join(dict.fromkeys(cfg.chars))
    loaded = AutoTokenizer.from_pretrained(str(out_dir))
    ids = loaded(probe, add_special_tokens=False)["input_ids"]
    if loaded.decode(ids) != probe or len(ids) != len(probe):
        raise RuntimeError(f"tokenizer round trip failed after save_pretrained: {probe!r} -> {loaded.decode(ids)!r}")
    log.info(
        "created tiny model in %s (%d params, vocab %d)",
        out_dir,
        sum(p.numel() for p in model.parameters()),
        vocab_size,
    )
    return out_dir
