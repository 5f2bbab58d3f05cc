"""End to end: the lookup example (examples/lookup_tools.yaml) as a user runs it: a random-init tiny model learns by
RL to call the argument-free calculator and copy its one-digit output; then the episodes left in the run's stream,
read back from its Redis (its append-only file), carry per-turn loss masks (the model's call and answer 1, the
tool's output 0) and per-token weight versions (the tool's output stamped with the version of the call before it).

CI runs the first CI_STEPS steps; the bars are a rise clearly above chance, below what the measured runs reached
at that step (docs/workflows.md, "Example: a tool call with no arguments (lookup)"); a run whose first valid call
comes late checks the per-turn layout on few or none of those episodes.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from relayrl.common.episodes import decode_group
from relayrl.common.model import load_tokenizer
from relayrl.common.pb import episode_pb2
from relayrl.common.redis_keys import RedisKeys
from relayrl.tasks.lookup import CALL, CHARS
from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model
from tests.conftest import REPO, RedisServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CI_STEPS = 150  # 51-109 s of pytest at a load average of 2-8 (other engineers' work)
CI_FINAL_REWARD = 0.08  # over steps 141-150 four runs were at 0.28-0.29, one (no valid call before step 200) at 0.11
CI_FINAL_CALL = 0.4  # the same five runs: call part 0.89-0.97, and 0.53, from 0.01-0.03


@pytest.fixture(scope="module")
def lookup_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("models") / "lookup", TinyModelConfig(chars=CHARS))


def _episodes(run: Path) -> list[episode_pb2.Episode]:
    """The episodes left in the run's stream (the trainer trims what it has consumed), read from its Redis data
    folder by a fresh redis-server."""
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed (scripts/ensure_system_deps.sh)"
    server = RedisServer(binary, free_port(), run / "redis")
    server.start()
    try:
        client = redis.Redis(port=server.port)
        entries = client.xrange(RedisKeys().stream)
    finally:
        server.stop()
    return [ep for _, fields in entries for ep in decode_group(fields).episodes]


def _check_turns(ep: episode_pb2.Episode, tokens: list[str]) -> None:
    """The call (mask 1), the tool's output <r>d</r> (mask 0, logprob 0, the call's last version), the answer
    (mask 1); versions never go down along the episode."""
    text = "".join(tokens)
    out_start = len(CALL)
    out_end = text.index("</r>", out_start) + len("</r>")
    masks, versions = list(ep.loss_mask), list(ep.token_weight_versions)
    assert masks == [1] * out_start + [0] * (out_end - out_start) + [1] * (len(tokens) - out_end), text
    assert all(ep.behaviour_logprobs[i] == 0.0 for i in range(out_start, out_end))
    assert set(versions[out_start:out_end]) == {versions[out_start - 1]}, (text, versions)
    assert versions == sorted(versions), (text, versions)


def test_lookup_example_learns_the_call_and_its_episodes_carry_per_turn_masks_and_versions(
        tmp_path: Path, lookup_model: Path) -> None:
    out = tmp_path / "run"

    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "run", "examples/lookup_tools.yaml", "--set",
                           f"model.path={lookup_model}", "--set", f"trainer.total_steps={CI_STEPS}", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == CI_STEPS
    first, last = (statistics.mean(r["reward_mean"] for r in w) for w in (rows[:10], rows[-10:]))
    assert first < 0.06 and last >= CI_FINAL_REWARD, f"reward {first:.3f} -> {last:.3f}"
    call_first, call_last = (statistics.mean(r["reward/call"] for r in w) for w in (rows[:10], rows[-10:]))
    assert call_last >= CI_FINAL_CALL and call_last > 3 * call_first, f"call {call_first:.3f} -> {call_last:.3f}"
    assert all(sum(r["episode_ends"].values()) == r["episodes"] and "single_turn" not in r["episode_ends"]
               for r in rows)
    assert rows[-1]["episodes_invalid"] == 0 and all(r["reward_errors"] == 0 for r in rows)
    tokenizer = load_tokenizer(str(lookup_model))
    episodes = _episodes(out)
    assert episodes  # the groups the trainer had not consumed (trimmed) when the run ended: 16 here
    for ep in episodes:
        tokens = tokenizer.convert_ids_to_tokens(list(ep.completion_token_ids))
        if "".join(tokens).startswith(CALL + "<r>"):
            _check_turns(ep, tokens)
        else:  # one model turn (or a call that failed): every token trained on, versions never going down
            assert all(m == 1 for m in ep.loss_mask[:len(CALL)]), "".join(tokens)
            assert list(ep.token_weight_versions) == sorted(ep.token_weight_versions)
    # four of five runs called the tool in over a thousand episodes by step 150; one made no valid call before step
    # 200, so the per-turn checks above cover the episodes that called, whichever they are
    # weight updates landed while episodes were generated: the trainer saw several versions in one episode
    assert sum(r["episodes_multi_version"] for r in rows) > 0
