"""The `reward_model` reward: a tiny Llama sequence classifier with one output (built here from a config, with the
test chat model's tokenizer and template) scores a chunk as one batch, exactly as it scores each input alone, in
the reward service's worker processes too; a classifier with two outputs is refused with an error, never a 0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.pb import reward_pb2 as pb
from relayrl.common.pb import reward_pb2_grpc as pb_grpc
from relayrl.reward.api import RewardInput
from relayrl.reward.scorer import Scorer, ScorerSpec
from relayrl.reward.verifiers.reward_model import RewardModelError, reward_model
from tests.integration.helpers import reward_server

COMPLETIONS = ["42", "The answer is 42.", "forty-two, I believe", "41", "I do not know the answer to this one"]


def _classifier(chat_model_dir: Path, out: Path, labels: int = 1) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=labels,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def classifier(chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _classifier(chat_model_dir, tmp_path_factory.mktemp("rm") / "rm")


def _inputs() -> list[RewardInput]:
    return [RewardInput(prompt="What is 6 x 7?", completion=c, reference="42") for c in COMPLETIONS]


def test_a_chunk_scored_as_one_padded_batch_equals_each_input_scored_alone(classifier: Path) -> None:
    together = reward_model(_inputs(), model=str(classifier))
    alone = [reward_model([inp], model=str(classifier))[0] for inp in _inputs()]

    # float32 on the CPU: padding changes only which masked positions exist, so the sums agree to rounding
    assert together == pytest.approx(alone, rel=1e-4, abs=1e-5)
    assert len(set(together)) == len(COMPLETIONS)  # the completions are told apart
    squashed = reward_model(_inputs(), model=str(classifier), normalize="sigmoid")
    assert squashed == pytest.approx([float(torch.sigmoid(torch.tensor(v))) for v in together], rel=1e-5)


def test_a_classifier_with_two_outputs_or_a_missing_model_is_an_error_not_a_score(
    chat_model_dir: Path, tmp_path: Path
) -> None:
    two = _classifier(chat_model_dir, tmp_path / "two", labels=2)
    scorer = Scorer(ScorerSpec(function="reward_model", params={"model": str(two)}))
    results = scorer.score_many(_inputs()[:2])
    assert all(isinstance(r, RewardModelError) and "2 outputs" in str(r) for r in results)
    with pytest.raises(RewardModelError, match="cannot load"):
        reward_model(_inputs()[:1], model=str(tmp_path / "nowhere"))


@pytest.mark.integration
async def test_the_reward_service_scores_a_batch_with_the_reward_model_in_its_workers(classifier: Path) -> None:
    expected = reward_model(_inputs(), model=str(classifier))
    async with (
        reward_server("reward_model", params={"model": str(classifier)}, workers=1) as (target, _),
        insecure_channel(target) as channel,
    ):
        stub = pb_grpc.RewardServiceStub(channel)
        requests = [
            pb.ScoreRequest(episode_id=str(i), prompt=inp.prompt, completion=inp.completion, reference=inp.reference)
            for i, inp in enumerate(_inputs())
        ]
        resp = await stub.ScoreBatch(pb.ScoreBatchRequest(requests=requests), timeout=60)

    assert [r.status for r in resp.responses] == [pb.SCORE_STATUS_OK] * len(COMPLETIONS)
    assert [r.score for r in resp.responses] == pytest.approx(expected, rel=1e-4, abs=1e-5)
