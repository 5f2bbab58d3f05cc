"""Config loading and validation: errors name the field, the value and the rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import RunConfig, dump_run_config, load_run_config
from relayrl.config.typed import ConfigError


def test_defaults_load_and_validate() -> None:
    cfg = load_run_config(None)

    assert isinstance(cfg, RunConfig)
    assert cfg.trainer.groups_per_step >= 1


def test_override_parses_yaml_scalars_into_typed_fields() -> None:
    cfg = load_run_config(None, ["trainer.optimizer.lr=0.01", "rollout.max_staleness=0", 'rollout.stop=["\\n", "##"]'])

    assert cfg.trainer.optimizer.lr == 0.01
    assert cfg.rollout.max_staleness == 0
    assert cfg.rollout.stop == ["\n", "##"]


@pytest.mark.parametrize(
    ("override", "field", "rule"),
    [
        ("rollout.max_staleness=-1", "rollout.max_staleness", ">= 0"),
        ("trainer.optimizer.lr=fast", "trainer.optimizer.lr", "must be a number"),
        ("trainer.total_steps=1.5", "trainer.total_steps", "must be an integer"),
        ("model.dtype=float64", "model.dtype", "one of"),
        ("trainer.loss.advantage=ppo", "trainer.loss.advantage", "one of 'grpo'"),
        ("trainer.lrr=0.1", "trainer.lrr", "unknown field"),
        ("rollout.max_new_tokens=100000", "rollout.max_new_tokens", "max_new_tokens_limit"),
        ("redis.url=http://x", "redis.url", "redis://"),
    ],
)
def test_invalid_value_error_names_field_value_and_rule(override: str, field: str, rule: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(None, [override])

    assert info.value.field == field
    assert rule in info.value.rule
    assert field in str(info.value)


def test_dumped_config_loads_back_identically(tmp_path: Path) -> None:
    cfg = load_run_config(None, ["trainer.total_steps=7", "rollout.temperature=0.7"])
    path = tmp_path / "config.yaml"

    dump_run_config(cfg, path)

    assert load_run_config(path) == cfg


def test_cli_invalid_config_exits_2_with_message(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("trainer:\n  total_steps: 0\n")

    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "run", str(config), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 2
    assert "trainer.total_steps = 0" in proc.stderr and ">= 1" in proc.stderr


def test_cli_missing_model_path_exits_2_naming_the_field(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "run",
            "examples/quickstart.yaml",
            "--set",
            f"model.path={tmp_path / 'nope'}",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[3],
    )

    assert proc.returncode == 2
    assert "model.path" in proc.stderr and "config.json" in proc.stderr


def test_cli_missing_dataset_exits_2_naming_the_field(tmp_path: Path, tiny_model_dir: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "run",
            "examples/quickstart.yaml",
            "--set",
            f"model.path={tiny_model_dir}",
            "--set",
            f"rollout.dataset={tmp_path / 'x.jsonl'}",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[3],
    )

    assert proc.returncode == 2
    assert "rollout.dataset" in proc.stderr and "does not exist" in proc.stderr


def test_tis_without_a_cap_is_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(None, ["trainer.loss.off_policy=tis", "trainer.loss.importance_cap=0"])

    assert info.value.field == "trainer.loss.importance_cap"


def test_partial_server_section_keeps_its_services_defaults(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "inference:\n  server: {reflection: false}\n  weights_server: {reflection: false}\n"
        "reward:\n  server: {port: 6000}\n"
    )

    cfg, defaults = load_run_config(path), load_run_config(None)

    assert cfg.inference.server.reflection is False and cfg.inference.weights_server.reflection is False
    # only the key given changes: inference's port and limits (its default_factory) stay, not ServerConfig's own
    assert cfg.inference.server.port == defaults.inference.server.port == 50051
    assert cfg.inference.server.max_receive_mib == defaults.inference.server.max_receive_mib == 8
    ws, default_ws = cfg.inference.weights_server, defaults.inference.weights_server
    assert ws.max_authenticated_rpcs == default_ws.max_authenticated_rpcs == 2
    assert cfg.reward.server.port == 6000
    assert cfg.reward.server.max_receive_mib == defaults.reward.server.max_receive_mib == 16


def test_deprecated_max_concurrent_rpcs_still_loads_with_a_warning_and_leaves_the_admission_budgets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("inference:\n  weights_server: {max_concurrent_rpcs: 2}\n")

    cfg, defaults = load_run_config(path), load_run_config(None)

    ws, default_ws = cfg.inference.weights_server, defaults.inference.weights_server
    assert "inference.weights_server.max_concurrent_rpcs is deprecated" in caplog.text
    assert (ws.max_authenticated_rpcs, ws.max_streams) == (default_ws.max_authenticated_rpcs, default_ws.max_streams)
    assert ws.hard_cap > ws.max_authenticated_rpcs + ws.max_unauthenticated_rpcs + ws.max_streams


def test_per_peer_stream_cap_above_the_global_one_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  server: {max_streams: 4, max_streams_per_peer: 8}\n")

    with pytest.raises(ConfigError) as info:
        load_run_config(path)

    assert info.value.field == "trainer.server.max_streams_per_peer"


def test_a_replica_may_name_its_own_weight_transport_but_not_auto_nor_shared_memory_among_others_sharded() -> None:
    two = "inference.endpoints=[{address: 'a:1', weights_address: 'a:2', transport: shared_memory}, {address: 'b:1', weights_address: 'b:2'}]"  # noqa: E501
    cfg = load_run_config(None, [two, "trainer.publication.transport=collective"])
    assert [e.transport for e in cfg.inference.endpoints] == ["shared_memory", None]

    with pytest.raises(ConfigError) as auto:
        load_run_config(None, [two.replace("shared_memory", "auto")])
    assert "auto is for the publication" in str(auto.value)
    with pytest.raises(ConfigError) as sharded:
        load_run_config(None, [two, "trainer.distributed.dp_shard=2", "trainer.distributed.world_size=2"])
    assert "inference.endpoints.transport" in str(sharded.value) and "dp_shard" in str(sharded.value)


def test_tensor_parallel_replicas_need_vllm_on_cuda() -> None:
    tp = "inference.vllm.tensor_parallel_size=2"
    cfg = load_run_config(None, [tp, "inference.engine=vllm", "model.device=cuda"])
    assert cfg.inference.vllm.tensor_parallel_size == 2
    for other in (["inference.engine=vllm"], ["model.device=cuda"]):
        with pytest.raises(ConfigError) as info:
            load_run_config(None, [tp, *other])
        assert info.value.field == "inference.vllm.tensor_parallel_size" and "vllm" in info.value.rule


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("name=a:b", "name"),
        ("name=", "name"),
        ("name=" + "x" * 65, "name"),
        ("redis.stream=relayrl:{run}:{other}", "redis.stream"),
        ("redis.version_key=v:{run}:{run}", "redis.version_key"),
    ],
)
def test_a_run_name_or_key_template_that_cannot_name_redis_keys_is_refused(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(None, [override])
    assert info.value.field == field
