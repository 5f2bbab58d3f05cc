"""bench/vs_trl.py's pure parts: thresholds and clocks on synthetic rows, TRL arguments equal to the relayrl
config, and the sequence task it adds (dataset, reward, model size). TRL itself is not needed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from relayrl.common.metrics_row import RlRow
from relayrl.config.run import load_run_config
from relayrl.config.typed import from_dict
from relayrl.reward.api import RewardInput
from relayrl.tasks import sequence
from tests.conftest import REPO, load_bench

vs = load_bench("vs_trl")
curves = load_bench("curves")  # the learning-curve figures vs_trl prints


def _rows(rewards: list[float], dt: float = 0.5) -> list:
    return [curves.StepRow(step=i + 1, time_s=(i + 1) * dt, reward=r, tokens=10.0) for i, r in enumerate(rewards)]


def test_time_to_threshold_on_rising_rewards_returns_first_step_whose_trailing_mean_reaches_it() -> None:
    # ten steps at 0.5, then 1.0: the 10-step mean first reaches 0.8 when 6 of the last 10 are 1.0 (step 16)
    rows = _rows([0.5] * 10 + [1.0] * 10)

    hit = curves.time_to_threshold(rows, 0.8)

    assert hit == (16, 8.0)


def test_time_to_threshold_with_fewer_rows_than_the_window_returns_none_even_when_all_are_above() -> None:
    rows = _rows([1.0] * 9)

    assert curves.time_to_threshold(rows, 0.8) is None


def test_time_to_threshold_never_reached_returns_none() -> None:
    rows = _rows([0.79] * 50)

    assert curves.time_to_threshold(rows, 0.8) is None


def test_summarise_synthetic_rows_gives_rates_final_reward_and_both_thresholds() -> None:
    rows = _rows([0.5] * 10 + [1.0] * 10)

    res = curves.summarise("x", rows, wall_s=20.0, max_reward=1.0)

    assert (res.steps, res.train_s, res.wall_s) == (20, 10.0, 20.0)
    assert res.steps_per_s == pytest.approx(2.0)
    assert res.tokens_per_s == pytest.approx(20.0)
    assert res.final_reward == pytest.approx(1.0)
    assert res.thresholds == {"0.8": {"step": 16, "time_s": 8.0}, "0.9": {"step": 18, "time_s": 9.0}}


def test_summarise_thresholds_scale_with_the_task_maximum() -> None:
    rows = _rows([1.7] * 10)

    res = curves.summarise("x", rows, wall_s=5.0, max_reward=2.0)

    assert res.thresholds["0.8"]["step"] == 10  # 1.7 >= 0.8 * 2
    assert res.thresholds["0.9"]["step"] is None  # 1.7 < 0.9 * 2


def test_summarise_without_rows_raises() -> None:
    with pytest.raises(RuntimeError, match="no training steps"):
        curves.summarise("relayrl", [], wall_s=1.0, max_reward=1.0)


def test_mean_result_over_seeds_averages_every_figure_and_thresholds_all_runs_reached() -> None:
    fast = curves.summarise("TRL", _rows([0.5] * 10 + [1.0] * 10), wall_s=20.0, max_reward=1.0)  # 0.8 at 16, 0.9 at 18
    slow = curves.summarise("TRL", _rows([0.5] * 10 + [1.0] * 10, dt=1.0), wall_s=30.0, max_reward=1.0)

    res = curves.mean_result("TRL", [fast, slow])

    assert res.system == "TRL mean"
    assert (res.wall_s, res.train_s) == (pytest.approx(25.0), pytest.approx(15.0))
    assert res.steps_per_s == pytest.approx((2.0 + 1.0) / 2)
    assert res.thresholds["0.8"] == {"step": pytest.approx(16.0), "time_s": pytest.approx((8.0 + 16.0) / 2)}


def test_mean_result_leaves_a_threshold_one_seed_never_reached_unset() -> None:
    reached = curves.summarise("relayrl", _rows([1.0] * 10), wall_s=5.0, max_reward=1.0)
    missed = curves.summarise("relayrl", _rows([0.85] * 10), wall_s=5.0, max_reward=1.0)

    res = curves.mean_result("relayrl", [reached, missed])

    assert res.thresholds["0.8"]["time_s"] == pytest.approx(5.0)
    # a mean over only the seeds that reached 0.9 would flatter: unset
    assert res.thresholds["0.9"] == {"step": None, "time_s": None}
    assert res.final_reward == pytest.approx(0.925)
    assert "relayrl mean" in curves.report([res], max_reward=1.0)


def test_relayrl_clock_starts_at_the_first_trainer_steps_start(tmp_path: Path) -> None:
    # row 1 ends 7.0 s after the trainer started and its step took 0.25 s: the clock's zero is at 6.75 s
    rows = [
        RlRow(step=1, time_s=7.0, step_time_s=0.25, reward_mean=0.1, episodes=128, completion_len_mean=2.0),
        RlRow(step=2, time_s=7.5, step_time_s=0.2, reward_mean=0.3, episodes=128, completion_len_mean=1.5),
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r.to_json()) + "\n" for r in rows))

    out = vs.relayrl_step_rows(metrics)

    assert [(r.step, r.reward, r.tokens) for r in out] == [(1, 0.1, 256.0), (2, 0.3, 192.0)]
    # float subtraction of decimal times: exact to rounding only
    assert [r.time_s for r in out] == pytest.approx([0.25, 0.75], rel=0, abs=1e-12)


@pytest.mark.parametrize("task", sorted(vs.TASKS))
def test_trl_arguments_equal_the_relayrl_config_of_each_task(task: str, tmp_path: Path) -> None:
    spec = vs.TASKS[task]
    overrides = vs.run_overrides(spec, tmp_path / "model", 123, ["seed=7", "rollout.seed=3"])
    cfg = load_run_config(REPO / spec.config, overrides)

    kw = vs.trl_kwargs(cfg, 123, tmp_path / "trl")

    rc, tc = cfg.rollout, cfg.trainer
    assert (cfg.model.path, tc.total_steps, tc.checkpoint.every) == (tmp_path / "model", 123, 0)
    assert kw["max_steps"] == 123 and kw["seed"] == 7 and kw["data_seed"] == 3
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == tc.groups_per_step * rc.group_size
    assert kw["num_generations"] == rc.group_size
    assert kw["max_completion_length"] == rc.max_new_tokens
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (rc.temperature, rc.top_p, rc.top_k)
    opt = tc.optimizer
    assert (kw["learning_rate"], kw["adam_beta1"], kw["adam_beta2"], kw["weight_decay"], kw["max_grad_norm"]) == (
        opt.lr,
        opt.beta1,
        opt.beta2,
        opt.weight_decay,
        opt.grad_clip,
    )
    assert kw["lr_scheduler_type"] == "constant" and kw["warmup_steps"] == 0
    assert kw["epsilon"] == tc.loss.clip_eps
    assert (kw["beta"], kw["num_iterations"], kw["loss_type"], kw["scale_rewards"]) == (0.0, 1, "dapo", "group")
    assert kw["bf16"] is False and kw["gradient_checkpointing"] is False


def test_user_overrides_of_shared_settings_reach_trl(tmp_path: Path) -> None:
    spec = vs.TASKS["quickstart"]
    user = [
        "rollout.group_size=4",
        "trainer.optimizer.lr=0.001",
        "rollout.max_new_tokens=3",
        "trainer.loss.advantage=dr_grpo",
        "trainer.loss.loss_aggregation=constant",
    ]
    cfg = load_run_config(REPO / spec.config, vs.run_overrides(spec, tmp_path, 10, user))

    kw = vs.trl_kwargs(cfg, 10, tmp_path)

    assert (kw["num_generations"], kw["per_device_train_batch_size"]) == (4, cfg.trainer.groups_per_step * 4)
    assert (kw["learning_rate"], kw["max_completion_length"]) == (0.001, 3)
    assert (kw["scale_rewards"], kw["loss_type"]) == ("none", "dr_grpo")


@pytest.mark.parametrize(
    "override",
    [
        "trainer.loss.advantage=rloo",
        "trainer.loss.off_policy=tis",
        "trainer.loss.policy_loss=gspo",
        "trainer.loss.mismatch_mask=token",
    ],
)
def test_settings_trl_cannot_express_are_refused(override: str, tmp_path: Path) -> None:
    spec = vs.TASKS["quickstart"]
    cfg = load_run_config(REPO / spec.config, vs.run_overrides(spec, tmp_path, 10, [override]))

    with pytest.raises(ValueError, match="no equivalent"):
        vs.trl_kwargs(cfg, 10, tmp_path)


def test_sequence_dataset_answers_continue_the_sequence_with_at_least_eight_digits(tmp_path: Path) -> None:
    n = sequence.make_dataset(tmp_path / "seq.jsonl", length=8, steps=(1, 3))

    rows = [json.loads(line) for line in (tmp_path / "seq.jsonl").read_text().splitlines()]

    assert n == len(rows) == 20
    by_prompt = {r["prompt"]: r["answer"] for r in rows}
    assert by_prompt["3+1="] == "34567890" and by_prompt["7+3="] == "70369258"
    assert all(len(a) == 8 for a in by_prompt.values())


def test_sequence_committed_datasets_match_their_generators(tmp_path: Path) -> None:
    sequence.make_dataset(tmp_path / "seq.jsonl")
    sequence.make_long_dataset(tmp_path / "seq32.jsonl")

    assert (tmp_path / "seq.jsonl").read_text() == (REPO / "examples/data/sequence.jsonl").read_text()
    assert (tmp_path / "seq32.jsonl").read_text() == (REPO / "examples/data/sequence32.jsonl").read_text()
    assert all(len(json.loads(line)["answer"]) == 32 for line in (tmp_path / "seq32.jsonl").read_text().splitlines())


@pytest.mark.parametrize(
    ("completion", "score"), [("35791357", 1.0), ("35791300", 0.75), ("357913579", 8 / 9), ("", 0.0)]
)
def test_sequence_reward_gives_credit_per_matching_position(completion: str, score: float) -> None:
    res = sequence.reward(RewardInput(prompt="3+2=", completion=completion, reference="35791357"))

    assert res.score == pytest.approx(score)


@pytest.mark.parametrize("task", ["sequence", "sequence32"])
def test_sequence_task_model_is_at_least_four_million_parameters(tmp_path: Path, task: str) -> None:
    from transformers import AutoModelForCausalLM

    from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model

    create_tiny_model(tmp_path, from_dict(TinyModelConfig, dict(vs.TASKS[task].model)))

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(tmp_path)).parameters())

    assert params >= 4_000_000
    assert vs.model_parameters(tmp_path) == params  # what the harness prints, read from the safetensors header


def test_without_trl_installed_the_harness_stops_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = vs.TASKS["quickstart"]
    cfg = load_run_config(REPO / spec.config, vs.run_overrides(spec, tmp_path, 10, []))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        vs.importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real_find_spec(name, *a)
    )

    with pytest.raises(SystemExit, match=r"TRL is not installed: pip install -e '\.\[bench\]'"):
        vs.run_trl(cfg, 10, tmp_path / "model", tmp_path / "trl", 1.0)

    assert not (tmp_path / "trl").exists()  # stopped before writing anything


def test_the_smollm2_task_gives_trl_relayrls_adapter_and_its_configured_verifier_on_conversations(
    tmp_path: Path,
) -> None:
    trl_grpo = load_bench("trl_grpo")
    spec = vs.TASKS["smollm2-lora"]
    cfg = load_run_config(REPO / spec.config, vs.run_overrides(spec, tmp_path / "model", 10, []))
    lora = cfg.model.lora

    assert vs.lora_kwargs(cfg) == {
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": lora.target_modules,
    }
    assert cfg.trainer.eval.every_steps == 0  # no in-run evaluation in a timed run
    score = trl_grpo.load_reward(cfg.reward.function, params=cfg.reward.params)
    prompt = [{"role": "user", "content": "What is 12 + 30?"}]
    completions = [[{"role": "assistant", "content": "12 + 30 = 42"}], [{"role": "assistant", "content": "41"}]]
    assert score([prompt, prompt], completions, ["42", "42"]) == [1.0, 0.0]
