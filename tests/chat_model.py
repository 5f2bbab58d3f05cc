"""A tiny Llama with a real byte-level BPE tokenizer, special tokens and a chat template, built offline (no
download), and a GGUF file of it written with the ``gguf`` package the way llama.cpp's converter writes one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

IM_START, IM_END, EOT, BOS = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>"
# ChatML with a BOS as the template defines it (the tokenizer adds none itself): the rendered prompt must hold
# exactly one BOS and end with the assistant header
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
CORPUS = [
    "What is 17 + 25? The answer is 42.",
    "Ünïcödé: naïve café, 東京, emoji ✓ 🙂",
    "user assistant system",
    "def f(x):\n    return x * 2\n",
    "The quick brown fox jumps over the lazy dog.",
] * 4


def build_chat_tokenizer() -> Any:
    """Byte-level BPE (GPT-2 style) trained on a small corpus; EOS ``<|endoftext|>``, BOS ``<s>``,
    end of turn ``<|im_end|>`` (a stop token through the generation config, as chat models declare it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOT, IM_START, IM_END, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOT, pad_token=EOT, unk_token=EOT)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def create_chat_model(out: Path, seed: int = 0, hidden: int = 64, layers: int = 2, ends_turn: bool = False) -> Path:
    """Save a random-init tiny Llama with the chat tokenizer; ``generation_config.eos_token_id`` lists EOS and
    end of turn. ``ends_turn``: a model that answers every prompt with ``<|im_end|>`` at once (probability ~1):
    every token embeds to the same vector, attention and MLP outputs are zero, and an untied output layer scores
    only ``<|im_end|>``."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_chat_tokenizer()
    eos, eot = tokenizer.convert_tokens_to_ids([EOT, IM_END])
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=not ends_turn,
        pad_token_id=eos,
        eos_token_id=eos,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    if ends_turn:
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(torch.ones(hidden))
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.lm_head.weight.zero_()
            model.lm_head.weight[eot] = 10.0
    model.generation_config = GenerationConfig(
        eos_token_id=[eos, eot], bos_token_id=tokenizer.bos_token_id, pad_token_id=eos
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order of the q/k projections (its converter permutes them for its RoPE layout)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tok_id(tok: dict[str, Any], content: str) -> int:
    return int(next(a["id"] for a in tok["added_tokens"] if a["content"] == content))


def write_gguf(model_dir: Path, path: Path) -> Path:
    """Write ``model_dir`` (a Llama made by create_chat_model) as an F32 GGUF with its tokenizer and template."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    sd = load_file(str(model_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "llama")
    heads, kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(float(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv_: kv_[1])
    for added in tok["added_tokens"]:
        vocab.append((added["content"], added["id"])) if added["id"] >= len(vocab) else None
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_eot_token_id(tok_id(tok, IM_END))
    w.add_add_bos_token(False)
    w.add_chat_template((model_dir / "chat_template.jinja").read_text())
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, t in sd.items():
        short = name.removeprefix("model.")
        if short in names:
            w.add_tensor(names[short], t.float().numpy())
            continue
        if not short.startswith("layers."):
            continue  # lm_head: tied to the embedding
        _, layer, rest = short.split(".", 2)
        part = rest.removesuffix(".weight")
        if part == "self_attn.q_proj":
            t = _permute(t, heads)
        elif part == "self_attn.k_proj":
            t = _permute(t, kv)
        w.add_tensor(f"blk.{layer}.{per_layer[part]}.weight", t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
