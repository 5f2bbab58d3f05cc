"""On-policy distillation through the real services: rollout samples from the student, a second inference server
serving a different (teacher) model scores the sampled tokens (ScoreTokens), and the trainer's reverse_kl loss
brings the student towards the teacher (the reverse KL falls)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model
from tests.conftest import RedisServer
from tests.integration.helpers import inference_server
from tests.integration.stack import run_stack, stack_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 24


def _peaked_teacher(out: Path) -> Path:
    """A wider model with other weights and the same character vocabulary, its final norm scaled up so that its
    next-token distributions are far from the near-uniform ones of a randomly initialised student."""
    from relayrl.common.model import load_model
    from relayrl.config.model import ModelConfig

    path = create_tiny_model(out, TinyModelConfig(hidden_size=128, intermediate_size=256, num_layers=2, seed=7))
    model = load_model(ModelConfig(path=path))
    model.model.norm.weight.data *= 40.0
    model.save_pretrained(str(path))
    return path


@pytest.mark.slow
async def test_the_student_moves_towards_a_teacher_served_by_an_inference_endpoint(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    teacher = _peaked_teacher(tmp_path / "teacher")

    async def go() -> dict:  # type: ignore[type-arg]
        async with inference_server(teacher) as (teacher_target, teacher_inf):
            cfg = stack_config(
                tmp_path / "run",
                tiny_model_dir,
                dataset_path,
                redis_server.url,
                f"trainer.total_steps={STEPS}",
                "trainer.checkpoint.every=0",
                "rollout.max_staleness=0",
                "trainer.loss.policy_loss=reverse_kl",
                f"trainer.teacher.address={teacher_target}",
                "trainer.optimizer.lr=0.01",
                "rollout.max_new_tokens=4",
            )
            out = await run_stack(cfg, tiny_model_dir, "tests.reward_fns:constant", timeout_s=300)
            out["teacher_requests"] = teacher_inf.requests_served
            return out

    out = await go()

    rows = out["rows"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert out["teacher_requests"] >= STEPS * 2 * 4  # every trained episode was scored by the teacher
    kl = [r["teacher_kl"] for r in rows]
    first, last = sum(kl[:4]) / 4, sum(kl[-4:]) / 4
    print("reverse KL to the teacher per step:", " ".join(f"{v:.3f}" for v in kl))
    assert first > 0.1  # two different models disagree
    assert last < 0.5 * first  # the student learned the teacher's distribution
