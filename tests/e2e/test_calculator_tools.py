"""End to end: the multi-turn example (examples/calculator_tools.yaml) as a user runs it. A random-init tiny model
learns two-digit addition by calling the calculator tool and copying its output; the trainer sees episodes whose
turns came from different weight versions; the trained model's episodes keep the tool's tokens out of the loss.

CI runs a shortened run with a lower bar (the full curve, 10 minutes on a 2-core machine, is in docs/workflows.md).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.client import InferenceClient, RewardClient
from relayrl.common.dataset import load_jsonl
from relayrl.common.model import load_tokenizer
from relayrl.common.pb import episode_pb2, reward_pb2
from relayrl.config.rollout import RolloutConfig, ToolFormat
from relayrl.rollout.workflows.api import WorkflowContext
from relayrl.rollout.workflows.loader import build_workflow
from relayrl.tasks.calculator import CHARS
from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model
from tests.conftest import REPO
from tests.integration.helpers import inference_server, reward_server

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CI_STEPS = 150  # about 2 minutes here
CI_FINAL_REWARD = 0.5


@pytest.fixture(scope="module")
def calc_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("models") / "calc", TinyModelConfig(chars=CHARS))


def _trained_episodes(model: Path) -> list[episode_pb2.Episode]:
    """Greedy episodes of the trained model on a few training prompts, through real inference and reward."""
    cfg = RolloutConfig(workflow="tools", tools=["relayrl.tasks.calculator:c"], tool_format=ToolFormat.TAGGED,
                        max_new_tokens=10, max_turns=3, max_tool_calls=2, max_episode_tokens=40, group_size=1,
                        top_k=1)
    workflow, env = build_workflow(cfg)
    rows = load_jsonl(REPO / "examples" / "data" / "calculator.jsonl")[:8]

    async def go() -> list[episode_pb2.Episode]:
        async with inference_server(model) as (target, _), \
                reward_server("relayrl.tasks.calculator:reward", workers=1) as (reward_target, _), \
                InferenceClient(target) as inference, RewardClient(reward_target) as reward:
            out = []
            for row in rows:
                ctx = WorkflowContext(inference=inference, reward=reward, group_id=row.prompt_id, group_size=1,
                                      producer_id="test", created_at=time.time(), config=cfg, environment=env)
                out += await workflow(row, ctx)
            return out

    return asyncio.run(go())


def test_calculator_example_learns_tool_use_with_tool_tokens_masked_and_versions_per_turn(
        tmp_path: Path, calc_model: Path) -> None:
    out = tmp_path / "run"

    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "run", "examples/calculator_tools.yaml", "--set",
                           f"model.path={calc_model}", "--set", f"trainer.total_steps={CI_STEPS}", "--set",
                           f"trainer.checkpoint.every={CI_STEPS}", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = statistics.mean(r["reward_mean"] for r in rows[:10])
    last = statistics.mean(r["reward_mean"] for r in rows[-10:])
    assert first < 0.2 and last >= CI_FINAL_REWARD, f"reward {first:.3f} -> {last:.3f}"
    # the model learned to call the tool and answer after reading its output
    assert statistics.mean(r["tool_calls_mean"] for r in rows[-10:]) > 0.5
    assert statistics.mean(r["turns_mean"] for r in rows[-10:]) > 1.5
    # weight updates landed between two turns of some episodes, and the trainer saw both versions in them
    assert sum(r["episodes_multi_version"] for r in rows) > 0

    checkpoint = sorted((out / "checkpoints").glob("step_*"))[-1] / "model"
    episodes = _trained_episodes(checkpoint)

    tokenizer = load_tokenizer(checkpoint)
    called = [e for e in episodes if e.tool_calls == 1 and e.turns == 2]
    assert called, [e.completion_text for e in episodes]
    for ep in called:
        # one sequence: the call (mask 1), the tool's output "<r>...</r>" (mask 0), the answer (mask 1)
        text = ep.completion_text
        start, end = text.index("<r>"), text.index("</r>") + len("</r>")
        pieces = [text[:start], text[start:end], text[end:]]
        lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in pieces]
        mask = list(ep.loss_mask)
        assert mask[:lengths[0]] == [1] * lengths[0]
        assert mask[lengths[0]:lengths[0] + lengths[1]] == [0] * lengths[1]
        assert set(mask[lengths[0] + lengths[1]:]) == {1}
        assert tokenizer.decode(ep.completion_token_ids[lengths[0]:lengths[0] + lengths[1]]) == pieces[1]
        assert all(lp == 0.0 for lp, m in zip(ep.behaviour_logprobs, mask, strict=True) if m == 0)
        assert ep.reward_status == reward_pb2.SCORE_STATUS_OK
