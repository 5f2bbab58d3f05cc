"""Configs that stay compatible: schema version, deprecations, removals, the schema snapshot, committed configs."""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

from relayrl.common.config import ConfigError, from_dict
from relayrl.common.config_schema import incompatible_changes
from relayrl.config import SCHEMA_VERSION, load_run_config
from relayrl.config import run as run_config
from tests.conftest import REPO


def test_deprecated_field_loads_with_a_warning_naming_replacement_and_release(caplog: pytest.LogCaptureFixture
                                                                              ) -> None:
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

    assert cfg.trainer.lr == 0.25 and cfg.schema_version == SCHEMA_VERSION + 1


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

    assert problems == ["a.bounded: bound tightened to >= 1", "a.gone: removed",
                        "a.mode: choices narrowed, ['y'] no longer accepted", "a.retyped: type changed from int to str"]


def test_compatibility_check_accepts_additions_widening_and_new_defaults() -> None:
    new = {**OLD, "a.kept": {"type": "int", "default": 9, "help": "x"}, "a.added": {"type": "int", "default": 0,
                                                                                  "help": ""},
           "a.mode": {"type": "choice", "choices": ["x", "y", "z"], "default": "x", "help": ""}}

    assert incompatible_changes(OLD, new) == []


def test_committed_reference_and_schema_snapshot_match_the_code() -> None:
    proc = subprocess.run([sys.executable, "scripts/gen_reference.py", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)

    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_config_loads_through_the_real_loader(path: Path) -> None:
    load_run_config(path)


def test_deprecated_reward_max_workers_still_sets_the_worker_count(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = load_run_config(None, ["reward.max_workers=3"])

    assert cfg.reward.workers == 3
    assert any("reward.max_workers" in r.getMessage() and "use workers" in r.getMessage() for r in caplog.records)
