"""Generation from a conversation over real gRPC: the server renders it once with the model's chat template, the
response carries exactly the ids the model saw, samples stop at end of turn, and the logprobs inference reports
are the trainer's own (same packing and logprob function as the learner)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from relayrl.client import InferenceClient
from relayrl.common.model import chat_token_ids, load_model, load_tokenizer
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb.common_pb2 import FINISH_REASON_STOP
from relayrl.config.model import ModelConfig
from relayrl.trainer.learner import pack
from relayrl.trainer.logprobs import token_logprobs
from tests.chat_model import IM_END, create_chat_model
from tests.integration.helpers import inference_server

pytestmark = pytest.mark.integration
CHAT = [{"role": "user", "content": "Wie viel ist 17 + 25? 東京 🙂"}]


def _sampling(**kw: object) -> pb.SamplingParams:
    return pb.SamplingParams(**{"n": 4, "max_new_tokens": 12, "temperature": 0.9, **kw})  # type: ignore[arg-type]


async def test_messages_are_rendered_once_and_logprobs_match_the_trainers(chat_model_dir: Path) -> None:
    tok = load_tokenizer(chat_model_dir)

    async def go() -> pb.GenerateResponse:
        async with inference_server(chat_model_dir) as (target, _), InferenceClient(target) as client:
            return await client.generate(CHAT, _sampling(), timeout_s=60)

    resp = await go()

    assert list(resp.prompt_token_ids) == chat_token_ids(tok, CHAT)
    model = load_model(ModelConfig(path=chat_model_dir))  # as the trainer loads it (float32)
    prompt = list(resp.prompt_token_ids)
    completions = [list(s.token_ids) for s in resp.samples]
    batch = pack(
        [prompt] * len(completions),
        completions,
        None,
        None,
        [0.9] * len(completions),
        tok.pad_token_id,
        torch.device("cpu"),
    )
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    trainer_lp = token_logprobs(logits, batch.targets, batch.temperature)
    for i, s in enumerate(resp.samples):
        start = len(prompt) - 1  # completion token j is predicted at position len(prompt) - 1 + j
        got = torch.tensor(list(s.logprobs))
        want = trainer_lp[i, start : start + len(s.token_ids)]
        # float32, KV-cache decode (inference) vs one padded forward (trainer): summation order only
        assert (got - want).abs().max().item() <= 1e-4


async def test_a_sample_ends_at_the_end_of_turn_token_of_the_generation_config(tmp_path: Path) -> None:
    model_dir = create_chat_model(tmp_path / "ends_turn", ends_turn=True)
    eot = load_tokenizer(model_dir).convert_tokens_to_ids(IM_END)

    async def go() -> pb.GenerateResponse:
        async with inference_server(model_dir) as (target, _), InferenceClient(target) as client:
            return await client.generate(CHAT, _sampling(), timeout_s=60)

    resp = await go()

    for s in resp.samples:  # <|im_end|> is not the tokenizer's EOS: it stops as the generation config's end of turn
        assert list(s.token_ids) == [eot] and s.finish_reason == FINISH_REASON_STOP
        assert s.text == ""  # special tokens are not part of the text


async def test_messages_to_a_model_without_a_chat_template_are_invalid_argument(tiny_model_dir: Path) -> None:
    async def go() -> None:
        async with inference_server(tiny_model_dir) as (target, _), InferenceClient(target) as client:
            await client.generate(CHAT, _sampling(), timeout_s=30)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await go()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat template" in (err.value.details() or "")


async def test_a_conversation_over_max_prompt_chars_is_resource_exhausted(chat_model_dir: Path) -> None:
    async def go() -> None:
        async with (
            inference_server(chat_model_dir, max_prompt_chars=10) as (target, _),
            InferenceClient(target) as client,
        ):
            await client.generate(CHAT, _sampling(), timeout_s=30)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await go()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
