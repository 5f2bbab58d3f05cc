"""docs/scaling.md names only what exists: its config keys (run config or chart values), Python names, files,
relayrl commands and Helm object names."""

from __future__ import annotations

import importlib
import re
import shlex
from typing import Any

import yaml

from relayrl.cli import SERVICES
from relayrl.config import RunConfig
from tests.conftest import REPO

PAGE = (REPO / "docs" / "scaling.md").read_text()
CODE = sorted(set(re.findall(r"`([^`\n]+)`", PAGE)))
CHART_VALUES = yaml.safe_load((REPO / "charts" / "relayrl" / "values.yaml").read_text())
KEY = re.compile(r"[a-z][a-z_]*(\.[a-zA-Z_]+)+")


def _has(tree: Any, path: list[str]) -> bool:
    for part in path:
        if isinstance(tree, dict):
            if part not in tree:
                return False
            tree = tree[part]
        elif hasattr(tree, "__dataclass_fields__"):
            if part not in tree.__dataclass_fields__:
                return False
            tree = getattr(tree, part)
        else:
            return False
    return True


def test_every_config_key_is_a_run_config_field_or_a_chart_value() -> None:
    keys = [c for c in CODE if KEY.fullmatch(c) and not c.startswith("relayrl.") and not c.endswith((".py", ".md"))]
    assert "reward.server.address" in keys
    run = RunConfig()
    for key in keys:
        parts = key.split(".")
        # a service section's key (server.x) holds for every service
        in_run = _has(run, parts) or all(_has(getattr(run, s), parts) for s in SERVICES if parts[0] == "server")
        assert in_run or _has(CHART_VALUES, parts), key


def test_every_python_name_imports_and_every_file_exists() -> None:
    for name in (c for c in CODE if c.startswith("relayrl.")):
        module, _, attr = name.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), name
    # a file named alone, or the script of a documented `python SCRIPT ...` command
    paths = [c for c in CODE if c.endswith((".py", ".md")) and "/" in c and " " not in c]
    paths += [c.split()[1] for c in CODE if c.startswith("python ")]
    assert "bench/scale_sim.py" in paths
    for path in paths:
        assert (REPO / path).is_file(), path


def test_every_relayrl_command_exists_and_the_compose_command_is_in_the_compose_file() -> None:
    from relayrl.cli import COMMANDS

    for command in (c for c in CODE if c.startswith("relayrl ")):
        assert shlex.split(command)[1] in {c.NAME for c in COMMANDS}, command
    assert "docker compose up --scale reward=3" in (REPO / "docker-compose.yml").read_text()


def test_the_headless_service_named_is_the_one_the_chart_renders() -> None:
    from tests.deploy.chart import render, service

    assert "`<release>-relayrl-reward-pods`" in PAGE
    assert service(render({}), "rl-relayrl-reward-pods")["spec"]["clusterIP"] == "None"
