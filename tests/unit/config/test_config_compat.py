"""Configs that stay compatible: schema version, deprecations, removals, the schema snapshot, committed configs."""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from relayrl.config import SCHEMA_VERSION, load_run_config
from relayrl.config import run as run_config
from relayrl.config.schema import incompatible_changes
from relayrl.config.typed import ConfigError, from_dict
from tests.conftest import REPO


def test_deprecated_field_loads_with_a_warning_naming_replacement_and_release(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = load_run_config(None, ["inference.batch_wait_ms=2"])

    assert cfg.inference.batch_wait_ms == 2
    [record] = [r for r in caplog.records if "deprecated" in r.getMessage()]
    assert "inference.batch_wait_ms" in record.getMessage() and "0.3" in record.getMessage()


@dataclass
class _Section:
    REMOVED_FIELDS: ClassVar[dict[str, str]] = {"old_lr": "removed in 0.2: use lr (same meaning)"}
    lr: float = field(default=0.1)


def test_removed_field_fails_with_its_migration_hint() -> None:
    with pytest.raises(ConfigError) as info:
        from_dict(_Section, {"old_lr": 0.5}, "trainer")

    assert info.value.field == "trainer.old_lr"
    assert "use lr" in info.value.rule


def test_config_from_a_newer_schema_is_refused() -> None:
    with pytest.raises(ConfigError, match="newer relayrl"):
        load_run_config(None, [f"schema_version={SCHEMA_VERSION + 1}"])


def test_config_from_an_older_schema_is_migrated(monkeypatch: pytest.MonkeyPatch) -> None:
    def rename_lr(data: dict[str, Any]) -> dict[str, Any]:
        trainer = dict(data.get("trainer", {}))
        trainer["lr"] = trainer.pop("learning_rate")
        return {**data, "trainer": trainer}

    monkeypatch.setattr(run_config, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    monkeypatch.setitem(run_config.MIGRATIONS, SCHEMA_VERSION, rename_lr)

    cfg = load_run_config(None, [f"schema_version={SCHEMA_VERSION}", "trainer.learning_rate=0.25"])

    assert cfg.trainer.optimizer.lr == 0.25 and cfg.schema_version == SCHEMA_VERSION + 1


OLD = {
    "a.kept": {"type": "int", "default": 1, "help": ""},
    "a.gone": {"type": "int", "default": 1, "help": ""},
    "a.retyped": {"type": "int", "default": 1, "help": ""},
    "a.mode": {"type": "choice", "choices": ["x", "y"], "default": "x", "help": ""},
    "a.bounded": {"type": "int", "default": 1, "help": "", "ge": 0},
}


def test_compatibility_check_flags_removal_retyping_narrowing_and_tightening() -> None:
    new = {
        "a.kept": {"type": "int", "default": 5, "help": "changed"},
        "a.retyped": {"type": "str", "default": "1", "help": ""},
        "a.mode": {"type": "choice", "choices": ["x"], "default": "x", "help": ""},
        "a.bounded": {"type": "int", "default": 1, "help": "", "ge": 1},
    }

    problems = incompatible_changes(OLD, new)

    assert problems == [
        "a.bounded: bound tightened to >= 1",
        "a.gone: removed",
        "a.mode: choices narrowed, ['y'] no longer accepted",
        "a.retyped: type changed from int to str",
    ]


def test_compatibility_check_accepts_additions_widening_and_new_defaults() -> None:
    new = {
        **OLD,
        "a.kept": {"type": "int", "default": 9, "help": "x"},
        "a.added": {"type": "int", "default": 0, "help": ""},
        "a.mode": {"type": "choice", "choices": ["x", "y", "z"], "default": "x", "help": ""},
    }

    assert incompatible_changes(OLD, new) == []


def test_committed_reference_and_schema_snapshot_match_the_code() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/gen_reference.py", "--check"], cwd=REPO, capture_output=True, text=True, timeout=120
    )

    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_config_loads_through_the_real_loader(path: Path) -> None:
    load_run_config(path)


def test_deprecated_reward_max_workers_still_sets_the_worker_count(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = load_run_config(None, ["reward.max_workers=3"])

    assert cfg.reward.workers == 3
    assert any("reward.max_workers" in r.getMessage() and "use workers" in r.getMessage() for r in caplog.records)


# -- trainer keys that moved into sections (schema 1's flat spelling keeps loading) ----------------------------


def _flat_trainer(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every moved trainer field written in its former flat spelling."""
    from relayrl.config.trainer import TrainerConfig

    trainer = copy.deepcopy(data.get("trainer", {}))
    for old, new in TrainerConfig.MOVED_FIELDS.items():
        section, leaf = new.split(".")
        if leaf in trainer.get(section, {}):
            trainer[old] = trainer[section].pop(leaf)
    for section in [k for k, v in trainer.items() if v == {}]:
        del trainer[section]
    return {**data, "trainer": trainer}


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_config_in_the_former_flat_spelling_loads_the_same(path: Path, tmp_path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    flat = _flat_trainer(data)
    assert flat != data or "trainer" not in data  # the examples do set moved keys
    old = tmp_path / path.name
    old.write_text(yaml.safe_dump(flat))

    assert load_run_config(old) == load_run_config(path)


def test_a_flat_trainer_key_loads_onto_its_section_with_a_warning_naming_the_new_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("trainer:\n  lr: 0.25\n  checkpoint_every: 3\n  weight_transport: shared_path\n")

    with caplog.at_level(logging.WARNING):
        cfg = load_run_config(path, ["trainer.keep_checkpoints=4"])

    assert cfg.trainer.optimizer.lr == 0.25 and cfg.trainer.checkpoint.every == 3
    assert cfg.trainer.checkpoint.keep == 4 and cfg.trainer.publication.transport.value == "shared_path"
    messages = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    for old, new in (
        ("trainer.lr", "trainer.optimizer.lr"),
        ("trainer.checkpoint_every", "trainer.checkpoint.every"),
        ("trainer.keep_checkpoints", "trainer.checkpoint.keep"),
    ):
        assert any(old in m and new in m for m in messages), (old, messages)


def test_setting_a_flat_trainer_key_and_its_new_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("trainer:\n  lr: 0.25\n  optimizer:\n    lr: 0.5\n")

    with pytest.raises(ConfigError) as info:
        load_run_config(path)

    assert info.value.field == "trainer.lr" and "trainer.optimizer.lr" in info.value.rule


def test_an_override_replaces_the_field_whichever_spelling_the_file_used(tmp_path: Path) -> None:
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("trainer:\n  checkpoint_every: 3\n")
    nested.write_text("trainer:\n  checkpoint:\n    every: 3\n")

    assert load_run_config(flat, ["trainer.checkpoint.every=5"]).trainer.checkpoint.every == 5
    assert load_run_config(nested, ["trainer.checkpoint_every=5"]).trainer.checkpoint.every == 5


def test_moved_keys_are_in_the_schema_and_moving_a_key_is_compatible() -> None:
    from relayrl.config import RunConfig
    from relayrl.config.schema import schema

    fields = schema(RunConfig)
    assert fields["trainer.lr"]["moved_to"] == "trainer.optimizer.lr"
    assert fields["trainer.lr"]["type"] == fields["trainer.optimizer.lr"]["type"]
    old = {"t.lr": {"type": "float", "default": 0.1, "help": "", "gt": 0}}
    moved = {
        "t.opt.lr": {"type": "float", "default": 0.1, "help": "", "gt": 0},
        "t.lr": {"type": "float", "default": 0.1, "help": "", "gt": 0, "moved_to": "t.opt.lr"},
    }
    assert incompatible_changes(old, moved) == []
    assert incompatible_changes(old, {"t.lr": moved["t.lr"]}) == ["t.lr: moved to t.opt.lr, which does not exist"]
    assert incompatible_changes(old, {"t.opt.lr": moved["t.opt.lr"]}) == ["t.lr: removed"]


def test_the_schema_snapshot_before_the_trainer_sections_is_compatible_with_the_code() -> None:
    from relayrl.config import RunConfig
    from relayrl.config.schema import schema

    before = json.loads((REPO / "tests" / "unit" / "data" / "config-schema-flat-trainer.json").read_text())["fields"]

    assert incompatible_changes(before, schema(RunConfig)) == []
