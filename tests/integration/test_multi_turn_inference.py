"""A multi-turn episode through the real inference service: token-in/token-out over gRPC, and a weight update that
lands between two turns of one episode, which the trainer then sees as two versions in it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from relayrl.client import InferenceClient
from relayrl.common.dataset import Prompt
from relayrl.common.episodes import Limits, validate_group
from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.model import load_tokenizer
from relayrl.common.pb import episode_pb2
from relayrl.common.pb import inference_pb2 as pb
from relayrl.common.pb import inference_pb2_grpc as pb_grpc
from relayrl.common.weights import iter_update_messages, model_tensors
from relayrl.config.rollout import RolloutConfig
from relayrl.rollout.workflows.api import StepResult, WorkflowContext
from relayrl.rollout.workflows.multi_turn import MultiTurnWorkflow
from relayrl.trainer.collectives import Collectives
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.step_summary import global_summary
from tests.conftest import WEIGHTS_TOKEN
from tests.integration.helpers import inference_server

pytestmark = pytest.mark.integration
AUTH = (("authorization", f"Bearer {WEIGHTS_TOKEN}"),)
OBSERVATION = "=12+3="


async def _one(messages: list[pb.WeightUpdateMessage]):  # type: ignore[no-untyped-def]
    for m in messages:
        yield m


class UpdatingEnvironment:
    """Two turns; after the first, the trainer publishes version 1 (the same tensors, a new version)."""

    def __init__(self, weights: pb_grpc.InferenceServiceStub, tensors: dict[str, torch.Tensor]) -> None:
        self.weights, self.tensors, self.steps = weights, tensors, 0

    async def reset(self, row: Prompt, seed: int) -> str:
        return row.prompt

    async def step(self, action: str) -> StepResult:
        self.steps += 1
        if self.steps == 1:
            await self.weights.UpdateWeights(
                _one(list(iter_update_messages(self.tensors, 1))), timeout=30, metadata=AUTH
            )
        return StepResult(observation=OBSERVATION, reward=1.0, done=self.steps == 2)

    async def close(self) -> None:
        return None


async def test_weight_update_between_turns_reaches_the_trainer_as_two_versions_in_one_episode(
    tiny_model_dir: Path,
) -> None:
    cfg = RolloutConfig(
        workflow="multi_turn",
        environment="unused:unused",
        max_new_tokens=4,
        max_turns=2,
        max_episode_tokens=32,
        group_size=1,
        temperature=1.0,
    )

    async def go() -> episode_pb2.Episode:
        async with (
            inference_server(tiny_model_dir) as (target, service),
            insecure_channel(service.weights_target) as wch,
            InferenceClient(target) as client,
        ):
            tensors = {k: v.clone() for k, v in model_tensors(service.engine.model).items()}
            env = UpdatingEnvironment(pb_grpc.InferenceServiceStub(wch), tensors)
            ctx = WorkflowContext(
                inference=client,
                reward=None,
                group_id="g",
                group_size=1,
                producer_id="test",
                created_at=time.time(),
                config=cfg,
            )
            return (await MultiTurnWorkflow(lambda row: env)(Prompt("p", "1+2=", ""), ctx))[0]

    ep = await go()

    tokenizer = load_tokenizer(tiny_model_dir)
    mask, versions = list(ep.loss_mask), list(ep.token_weight_versions)
    first = mask.index(0)
    obs_len = mask[first:].index(1)
    obs_ids = list(ep.completion_token_ids[first : first + obs_len])
    # the observation's ids are the server's tokenization of its text, appended to the sampled ids unchanged
    assert obs_ids == tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    assert list(ep.prompt_token_ids) == tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    assert ep.turns == 2 and ep.episode_end == episode_pb2.EPISODE_END_DONE and ep.reward == 2.0
    # turn 1 under version 0, its observation stamped 0, turn 2 under version 1
    assert set(versions[: first + obs_len]) == {0} and set(versions[first + obs_len :]) == {1}
    group = episode_pb2.EpisodeGroup(group_id="g", episodes=[ep])
    assert validate_group(group, Limits(len(tokenizer), cfg.episode_token_cap(), newest_version=1)) is None
    # the trainer's view: one episode with two versions; its staleness counts from the oldest token (version 0)
    summary = global_summary(Collectives(None, 10.0), 1, StepBatch.of([ep], [1.0]))
    assert summary.episodes_multi_version == 1 and min(ep.token_weight_versions) == 0
    assert summary.turns_mean == 2.0 and summary.episode_ends == {"done": 1}
