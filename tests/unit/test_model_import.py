"""`relayrl import-model`: a GGUF file (written here with the gguf package) or a Hugging Face directory becomes a
plain safetensors directory with the same logits, tokenizer, chat template and stop tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.cli import main
from relayrl.config.typed import ConfigError
from relayrl.model_import import import_model
from tests.chat_model import IM_END, create_chat_model, write_gguf

pytest.importorskip("gguf")

TEXT = "Ünïcödé 東京 🙂 What is 17 + 25?"


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)(input_ids=ids).logits


def test_gguf_import_gives_the_same_logits_tokens_template_and_stop_tokens(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    src = create_chat_model(tmp_path / "hf")
    gguf_file = write_gguf(src, tmp_path / "tiny.gguf")

    rc = main(["import-model", str(gguf_file), "--out", str(tmp_path / "out")])

    assert rc == 0
    out = tmp_path / "out"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    want, got = AutoTokenizer.from_pretrained(str(src)), AutoTokenizer.from_pretrained(str(out))
    assert got(TEXT)["input_ids"] == want(TEXT)["input_ids"]  # multi-byte characters included
    assert got.chat_template == want.chat_template
    assert (got.bos_token, got.eos_token) == (want.bos_token, want.eos_token)
    ids = torch.tensor([want(TEXT)["input_ids"]])
    # F32 GGUF tensors are the HF weights bit for bit (q/k rows un-permuted): only summation order may differ
    torch.testing.assert_close(_logits(out, ids), _logits(src, ids), rtol=0, atol=1e-5)
    gen = json.loads((out / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == {want.eos_token_id, want.convert_tokens_to_ids(IM_END)}  # GGUF's eot kept
    report = json.loads((out / "relayrl_import.json").read_text())
    assert report["chat_template"] is True and report["max_abs_logit_diff"] <= 1e-4


def test_hf_directory_import_in_bfloat16_saves_bfloat16_weights(tmp_path: Path) -> None:
    from safetensors import safe_open

    src = create_chat_model(tmp_path / "hf")

    report = import_model(src, tmp_path / "out", dtype="bfloat16")

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118 (not a dict)
    assert report.max_abs_logit_diff > 0  # rounded weights: the check really compared something


def test_import_refuses_a_non_empty_output_without_force(tmp_path: Path) -> None:
    src = create_chat_model(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")

    with pytest.raises(ConfigError, match="not empty"):
        import_model(src, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


def test_import_into_the_source_folder_is_refused_even_with_force(tmp_path: Path) -> None:
    src = create_chat_model(tmp_path / "hf")

    with pytest.raises(ConfigError, match="must not be or hold the source"):
        import_model(src, src, force=True)
    with pytest.raises(ConfigError, match="must not be or hold the source"):
        import_model(src / "model.safetensors", tmp_path, force=True)
    assert (src / "model.safetensors").is_file()


def test_import_of_a_path_that_is_no_model_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")

    assert main(["import-model", str(tmp_path / "notes.txt"), "--out", str(tmp_path / "out")]) == 2


@pytest.mark.slow
def test_the_packaged_smollm2_gguf_imports_with_its_chat_template(smollm2_import: Any) -> None:
    report = smollm2_import  # imported once for the session (tests/e2e/test_smollm2_stack.py trains it)

    assert report.params == 134_515_008 and report.chat_template and report.max_abs_logit_diff <= 1e-4
    assert report.eos_token_ids == [2]  # <|im_end|>: SmolLM2's EOS is its end-of-turn token
