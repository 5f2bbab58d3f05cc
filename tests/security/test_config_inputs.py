"""Config input is untrusted text: non-finite numbers, YAML syntax errors and secret values get clean errors that
never echo a secret, and the resolved config is written readable by its owner only."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import dump_run_config, load_run_config
from relayrl.config.typed import ConfigError
from tests.conftest import REPO

pytestmark = pytest.mark.security

SECRET = "hunter2-very-secret"


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_number_is_refused_even_where_only_a_lower_bound_applies(value: str) -> None:
    with pytest.raises(ConfigError, match="must be a finite number") as err:
        load_run_config(None, [f"reward.timeout_s={value}"])

    assert err.value.field == "reward.timeout_s"


def test_yaml_syntax_error_exits_2_with_line_and_column_and_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_steps: 3\n rollout: [\n")

    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "run", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=60
    )

    assert proc.returncode == 2, proc.stderr
    assert "line 3, column 2" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "override",
    [
        f"control.token={{nested: {SECRET}}}",  # wrong type of a secret field
        f"redis.url=http://user:{SECRET}@host:6379",  # a secret field refused by its section's validate()
        f"control.tokn={SECRET}",  # a mistyped key: its value may be the secret
        f"control.token=[{SECRET}",  # not YAML at all
    ],
)
def test_config_error_about_a_secret_never_shows_its_value(override: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_run_config(None, [override])

    assert SECRET not in str(err.value)
    assert SECRET not in repr(err.value.value)


def test_config_error_of_a_secret_from_the_cli_is_not_printed(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"redis:\n  url: ftp://:{SECRET}@h\n")

    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "run", str(cfg)], cwd=REPO, capture_output=True, text=True, timeout=60
    )

    assert proc.returncode == 2
    assert "redis.url" in proc.stderr and SECRET not in proc.stderr + proc.stdout


def test_resolved_config_is_written_owner_only_also_over_a_world_readable_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("old\n")
    path.chmod(0o644)
    cfg = load_run_config(None, [f"control.token={SECRET}"])

    dump_run_config(cfg, path)

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_run_config(path).control.token == SECRET
