"""Length limits beyond the model are refused at start-up, not found later: inference.max_prompt_tokens,
inference.max_new_tokens_limit, rollout.max_new_tokens and trainer.publication.probe_tokens against the model's
context length (config.json), rollout.top_k against its vocabulary, the trainer's probe against
inference.max_probe_tokens, rollout.temperature against what inference accepts. `relayrl run` exits 2 naming the
field before it starts anything; each service refuses at its own start, before it loads the model. A limit left at
its default is lowered to the model's bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import RunConfig, load_run_config
from relayrl.config.model_fit import fit_to_model
from relayrl.config.typed import ConfigError

pytestmark = pytest.mark.security
REPO = Path(__file__).resolve().parents[2]


def _config(model: Path, *overrides: str) -> RunConfig:
    return load_run_config(None, [f"model.path={model}", *overrides])


@pytest.mark.parametrize(
    ("override", "field", "bound"),
    [
        ("inference.max_prompt_tokens=1000000", "inference.max_prompt_tokens", 255),
        ("inference.max_new_tokens_limit=5000", "inference.max_new_tokens_limit", 255),
        ("trainer.publication.probe_tokens=1000", "trainer.publication.probe_tokens", 256),
        ("rollout.top_k=1000", "rollout.top_k", None),
    ],
)
def test_a_limit_beyond_the_models_context_or_vocabulary_is_refused_naming_field_value_and_bound(
    tiny_model_dir: Path, override: str, field: str, bound: int | None
) -> None:
    cfg = _config(tiny_model_dir, override)

    with pytest.raises(ConfigError) as err:
        fit_to_model(cfg)

    assert err.value.field == field and str(err.value.value) == override.split("=")[1]
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    assert f"must be <= {bound if bound is not None else vocab}" in err.value.rule
    assert str(tiny_model_dir / "config.json") in err.value.rule  # where the model's bound comes from


def test_probe_tokens_beyond_the_probe_limit_is_refused_at_load(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _config(tiny_model_dir, "trainer.publication.probe_tokens=100000")

    assert err.value.field == "trainer.publication.probe_tokens" and "inference.max_probe_tokens" in err.value.rule


@pytest.mark.parametrize(
    "override",
    ["rollout.temperature=1000", "rollout.temperature=0.000001", "rollout.stop=[" + ",".join(["x"] * 65) + "]"],
)
def test_rollout_sampling_beyond_what_inference_accepts_is_refused_at_load(tiny_model_dir: Path, override: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(tiny_model_dir, override)

    assert err.value.field == override.split("=")[0]


def test_limits_at_their_defaults_are_lowered_to_the_model_and_set_ones_that_fit_are_kept(tiny_model_dir: Path) -> None:
    fitted = fit_to_model(_config(tiny_model_dir, "rollout.max_new_tokens=255"))

    assert fitted.inference.max_prompt_tokens == 255 and fitted.inference.max_new_tokens_limit == 255  # 2048 each
    assert fitted.rollout.max_new_tokens == 255 and fitted.trainer.publication.probe_tokens == 16
    assert fit_to_model(fitted) == fitted  # what `relayrl run` writes, each service accepts as it is


def test_relayrl_run_exits_2_naming_the_field_before_starting_any_service(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {tiny_model_dir}\ninference:\n  max_prompt_tokens: 1000000\n")
    out = tmp_path / "out"

    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "run", str(config), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )

    assert proc.returncode == 2, proc.stderr
    assert "inference.max_prompt_tokens = 1000000" in proc.stderr and "context length 256" in proc.stderr
    assert not (out / "logs").exists()  # no service (nor Redis) was started


@pytest.mark.parametrize("service", ["inference", "trainer", "rollout"])
async def test_each_service_refuses_a_limit_beyond_the_model_at_its_own_start(
    tiny_model_dir: Path, service: str
) -> None:
    import importlib

    override = {
        "inference": "inference.max_prompt_tokens=1000000",
        "trainer": "trainer.publication.probe_tokens=300",
        "rollout": "rollout.top_k=1000",
    }[service]
    cfg = _config(tiny_model_dir, override)
    serve = importlib.import_module(f"relayrl.{service}.main").serve

    with pytest.raises(ConfigError) as err:
        await serve(cfg)

    assert err.value.field == override.split("=")[0]
