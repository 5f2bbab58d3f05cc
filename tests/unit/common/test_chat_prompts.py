"""Conversation datasets: `messages` rows, rendered once with the model's chat template into exactly the ids the
model sees (BOS as the template writes it, special tokens, multi-byte characters), and the stop tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.common.dataset import open_prompts
from relayrl.common.model import chat_token_ids, end_token_ids, load_generation_config, load_tokenizer
from relayrl.config.dataset import DatasetSpec
from relayrl.config.typed import ConfigError
from tests.chat_model import IM_END, IM_START

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wie viel ist 17 + 25? 東京 🙂"}]


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def test_messages_rows_load_with_the_last_user_turn_as_the_verifier_prompt(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "d.jsonl",
        [{"id": "a", "messages": CHAT, "answer": 42, "level": 2}, {"prompt": "1+1=", "answer": "2"}],
    )

    chat, text = open_prompts(DatasetSpec(path)).train

    assert chat.chat() == CHAT and chat.prompt == CHAT[1]["content"] and chat.answer == "42"
    assert chat.metadata == {"level": 2}
    assert text.messages == () and text.chat() == [] and text.prompt == "1+1="


@pytest.mark.parametrize(
    "row",
    [
        {"messages": [], "answer": "1"},
        {"messages": [{"role": "user"}], "answer": "1"},
        {"messages": [{"role": "", "content": "x"}], "answer": "1"},
        {"messages": "hello", "answer": "1"},
        {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "answer": "1"},
        {"messages": [{"role": "user", "content": "x"}]},
    ],
)
def test_malformed_messages_rows_are_config_errors_naming_the_line(tmp_path: Path, row: dict[str, object]) -> None:
    path = _write(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1"}, row])

    with pytest.raises(ConfigError, match=r"d\.jsonl:2"):
        open_prompts(DatasetSpec(path))


def test_rendering_holds_one_bos_the_turn_markers_and_ends_with_the_generation_prompt(chat_model_dir: Path) -> None:
    tok = load_tokenizer(chat_model_dir)

    ids = chat_token_ids(tok, CHAT)

    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id  # the template's BOS, not doubled
    assert tok.decode(ids) == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        f"{CHAT[1]['content']}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[-3:] == tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-3:]
    assert tok.convert_tokens_to_ids(IM_START) in ids and tok.convert_tokens_to_ids(IM_END) in ids


def test_multi_byte_characters_survive_rendering_and_decoding(chat_model_dir: Path) -> None:
    tok = load_tokenizer(chat_model_dir)
    text = "naïve café 東京 🙂 ✓"

    ids = chat_token_ids(tok, [{"role": "user", "content": text}])

    assert text in tok.decode(ids)
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level: a lossless round trip


def test_a_tokenizer_without_a_chat_template_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        chat_token_ids(load_tokenizer(tiny_model_dir), CHAT)


def test_end_token_ids_are_eos_then_the_generation_configs_end_of_turn(chat_model_dir: Path) -> None:
    tok = load_tokenizer(chat_model_dir)

    ids = end_token_ids(tok, load_generation_config(chat_model_dir))

    assert ids == [tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)]
    assert end_token_ids(tok, None) == [tok.eos_token_id]
