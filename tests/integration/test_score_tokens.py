"""Inference's ScoreTokens RPC (the teacher's and an endpoint reference's logprobs of given ids) on a real server."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from relayrl.client import InferenceClient
from relayrl.common.model import load_model
from relayrl.config.model import ModelConfig
from tests.integration.helpers import inference_server

pytestmark = pytest.mark.integration

SEQUENCES = [([5, 9, 11], [16, 3, 7, 8], 1.0), ([4], [6, 6], 0.7)]


def _reference(model_dir: Path) -> list[list[float]]:
    """The same logprobs from the model itself: log softmax(logits / T) at each completion token."""
    model = load_model(ModelConfig(path=model_dir))
    out = []
    with torch.no_grad():
        for prompt, completion, temp in SEQUENCES:
            ids = torch.tensor([prompt + completion])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temp, dim=-1)
            out.append([float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)])
    return out


async def test_score_tokens_returns_the_served_models_logprobs_of_the_given_completions(tiny_model_dir: Path) -> None:
    async def go() -> tuple[list[list[float]], int]:
        async with inference_server(tiny_model_dir) as (target, _), InferenceClient(target) as client:
            reply = await client.score(SEQUENCES, timeout_s=30)
            return [list(s.logprobs) for s in reply.scores], reply.weight_version

    scores, version = await go()

    assert [len(s) for s in scores] == [4, 2]
    assert version == 0  # the weights loaded at start-up, before any update
    for got, want in zip(scores, _reference(tiny_model_dir), strict=True):
        # float32 forward passes of the same tokens, batched and padded differently: rounding only
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("sequences", "code"),
    [
        ([([1], [2], 1.0)] * 3, grpc.StatusCode.RESOURCE_EXHAUSTED),  # over max_samples_per_request (2)
        ([([1] * 40, [2], 1.0)], grpc.StatusCode.RESOURCE_EXHAUSTED),  # prompt + completion over max_prompt_tokens
        ([([1], [], 1.0)], grpc.StatusCode.INVALID_ARGUMENT),  # nothing to score
        ([([1], [10**6], 1.0)], grpc.StatusCode.INVALID_ARGUMENT),  # an id outside the vocabulary
        ([([1], [2], -1.0)], grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_score_tokens_refuses_requests_over_its_limits_at_once(
    tiny_model_dir: Path, sequences: list[tuple[list[int], list[int], float]], code: grpc.StatusCode
) -> None:
    async def go() -> grpc.StatusCode:
        async with (
            inference_server(tiny_model_dir, max_samples_per_request=2, max_prompt_tokens=32) as (target, _),
            InferenceClient(target, retries=0) as client,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.score(sequences, timeout_s=30)
            return err.value.code()

    assert await go() == code
