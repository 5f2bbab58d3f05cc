"""The run folder of `relayrl run` is its owner's (output_dir_mode, default 0700): the launcher's umask follows it,
so every file a writer of the run creates (the launcher, redis-server, the services) has no group/other bits; a
reused folder is closed again. A whole run's folder is walked in tests/security/test_run_exposure.py."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.config import load_run_config
from relayrl.config.typed import ConfigError
from tests.conftest import REPO

pytestmark = pytest.mark.security


@pytest.fixture
def umask_kept() -> Iterator[None]:
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


def _launcher(tmp_path: Path, *overrides: str) -> object:
    from relayrl.launcher import Launcher

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    cfg = load_run_config(
        None, [f"model.path={model}", f"rollout.dataset={REPO / 'examples/data/arithmetic.jsonl'}", *overrides]
    )
    return Launcher(cfg, tmp_path / "run")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_reused_wide_open_run_folder_is_closed_and_new_files_are_owner_only(tmp_path: Path, umask_kept: None) -> None:
    out = tmp_path / "run"
    for folder in (out / "logs", out / "checkpoints", out / "redis", out / "unrelated"):
        folder.mkdir(parents=True)
        folder.chmod(0o755)
    out.chmod(0o755)
    launcher = _launcher(tmp_path)

    previous = launcher._prepare_folder()  # type: ignore[attr-defined]
    try:
        (out / "logs" / "new.log").write_text("x")
        (out / "checkpoints" / "step_000001").mkdir()
    finally:
        os.umask(previous)

    assert [_mode(out / p) for p in ("", "logs", "checkpoints", "redis")] == [0o700] * 4
    assert _mode(out / "unrelated") == 0o755  # not the run's: left as it was (unreachable below a 0700 folder)
    assert _mode(out / "logs" / "new.log") == 0o600 and _mode(out / "checkpoints" / "step_000001") == 0o700


def test_output_dir_mode_0750_shares_the_run_read_only_with_the_group(tmp_path: Path, umask_kept: None) -> None:
    launcher = _launcher(tmp_path, "output_dir_mode='0750'")

    previous = launcher._prepare_folder()  # type: ignore[attr-defined]
    try:
        (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    finally:
        os.umask(previous)

    assert _mode(tmp_path / "run") == 0o750 and _mode(tmp_path / "run" / "metrics.jsonl") == 0o640


@pytest.mark.parametrize(
    ("value", "rule"),
    [("0777", "must not let group or others write"), ("0600", "owner rwx"), ("755x", "octal"), ("0702", "write")],
)
def test_an_output_dir_mode_open_to_writers_or_closing_the_owner_out_is_a_config_error(value: str, rule: str) -> None:
    with pytest.raises(ConfigError, match=rule):
        load_run_config(None, [f"output_dir_mode='{value}'"])
