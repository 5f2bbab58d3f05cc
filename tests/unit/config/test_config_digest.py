"""`relayrl serve` refuses a config file that changed since its pod was created (RELAYRL_CONFIG_SHA256, set by the
Helm chart): a ConfigMap volume is updated under running pods, so a restarted process would otherwise load a newer
config than its peers in the same torchrun group."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.config.sources import CONFIG_DIGEST_ENV, check_config_digest
from relayrl.config.typed import ConfigError

TEXT = "name: a\ntrainer:\n  total_steps: 4\n"


def _digest(text: str) -> str:
    return hashlib.sha256(text.rstrip("\n").encode()).hexdigest()


def test_the_config_the_pod_was_created_for_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "relayrl.yaml"
    path.write_text(TEXT)
    monkeypatch.setenv(CONFIG_DIGEST_ENV, _digest(TEXT).upper())
    check_config_digest(path)  # no error; trailing newlines and the digest's case do not matter


def test_without_the_variable_nothing_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_DIGEST_ENV, raising=False)
    check_config_digest(tmp_path / "absent.yaml")  # not even read


def test_a_changed_config_stops_serve_naming_the_variable_and_both_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "relayrl.yaml"
    path.write_text(TEXT.replace("4", "5"))  # the ConfigMap after `helm upgrade`
    monkeypatch.setenv(CONFIG_DIGEST_ENV, _digest(TEXT))

    with pytest.raises(ConfigError, match="has changed since this process's pod was created"):
        check_config_digest(path)
    code = main(["serve", "trainer", str(path)])

    err = capsys.readouterr().err
    assert code != 0 and CONFIG_DIGEST_ENV in err and _digest(TEXT.replace("4", "5")) in err
