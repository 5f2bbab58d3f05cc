"""The policy model's section: where it is, its dtype and device (shared by inference and trainer)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from relayrl.config.lora import LoraConfig
from relayrl.config.typed import ConfigError

# config.json keys of a model's context length, in the order they are looked for (Llama/Qwen/Mistral..., GPT-2,
# GPT-J/MPT-like, ChatGLM/Qwen1); a multimodal config holds its language model's under text_config
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


@dataclass(frozen=True)
class ModelFacts:
    """What the run's limits are checked against, read from the model's config.json (None: not stated there)."""

    source: Path  # the config.json read
    context_length: int | None
    context_key: str  # the key it was read from
    vocab_size: int | None


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass
class ModelConfig:
    """The policy model, shared by inference (serving) and trainer (learning)."""

    path: Path = field(
        default=Path("models/tiny"),
        metadata={"help": "Local Hugging Face model directory (config.json, safetensors, tokenizer files)."},
    )
    dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "Parameter dtype for inference and training."}
    )
    device: str = field(default="cpu", metadata={"help": "torch device: cpu, cuda or cuda:N."})
    lora: LoraConfig = field(
        default_factory=LoraConfig,
        metadata={
            "help": "LoRA adapters (trainer trains them, inference serves base + adapter; updates carry the adapter)."
        },
    )

    def validate(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError("device", self.device, "must be cpu, cuda or cuda:N")

    def check_exists(self) -> None:
        """Stop start-up with a clear error when the model directory is missing or incomplete."""
        if not (self.path / "config.json").is_file():
            raise ConfigError(
                "model.path",
                str(self.path),
                "must be a Hugging Face model directory containing config.json "
                "(create the demo model with: relayrl init-model)",
            )

    def facts(self) -> ModelFacts | None:
        """The model's context length and vocabulary size from ``<path>/config.json`` (torch-free); None when the
        directory has no config.json (a service that does not need the model, e.g. rollout, may run without it).
        ConfigError for a config.json that is not a JSON object."""
        source = self.path / "config.json"
        if not source.is_file():
            return None
        try:
            data = json.loads(source.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError("model.path", str(self.path), f"config.json cannot be read as JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("model.path", str(self.path), "config.json must hold a JSON object")
        text = data.get("text_config")
        scopes = [data, *([text] if isinstance(text, dict) else [])]
        context, key = None, ""
        for scope in scopes:
            for k in CONTEXT_KEYS:
                if context is None and _positive_int(scope.get(k)) is not None:
                    context, key = scope[k], k
        vocab = next((v for v in (_positive_int(sc.get("vocab_size")) for sc in scopes) if v is not None), None)
        return ModelFacts(source, context, key, vocab)
