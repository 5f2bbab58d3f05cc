"""What the user documentation (README.md, docs/*.md) names must exist: every `relayrl` command and flag in the
argument parser, every config key in the run config or the Helm chart's values, every config snippet loadable,
every repository path on disk, every `relayrl.x.y` module (or proto package, or entry-point group), every
Prometheus series among those the services export."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from relayrl.cli import parser as cli_parser
from relayrl.config import load_run_config
from relayrl.config.run import RunConfig
from tests.conftest import REPO
from tests.metrics_series import exported_names

PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
CODE = re.compile(r"```[\w-]*\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`\n]+)`")
# names that look like a reference and are not one, each with why
NOT_REFERENCES = {
    "trainer.nodez": "deploy.md's example of a typo the chart's schema refuses",
    "relayrl.a.b": "architecture.md's placeholder for any module",
    "src/relayrl/a/b.py": "architecture.md's placeholder for any module's file",
    "relayrl.internal": "security.md's example of a TLS server name",
}
FILE_SUFFIXES = (".json", ".proto", ".svg", ".safetensors", ".yaml", ".jsonl", ".png", ".md", ".py")
ENTRY_POINT_GROUPS = ("relayrl.environments", "relayrl.workflows", "relayrl.tools", "relayrl.rewards")


def _snippets(page: Path) -> tuple[list[str], list[str]]:
    """The page's code blocks, and its inline code outside them."""
    text = page.read_text()
    return CODE.findall(text), INLINE.findall(CODE.sub("", text))


def _all_code(page: Path) -> list[str]:
    blocks, inline = _snippets(page)
    return blocks + inline


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_lines(page: Path) -> list[str]:
    """The text after each `relayrl` that runs it: code-block lines (comments cut) and inline code."""
    blocks, inline = _snippets(page)
    lines = [
        line.split(" #")[0] for block in blocks for line in block.splitlines() if not line.lstrip().startswith("#")
    ]
    found = []
    for line in [*lines, *inline]:
        found += [m.group(1) for m in re.finditer(r"(?:^|[\s(/:])relayrl((?: [^\s|;&>#`)]+)*)", line)]
    return found


def _check_command(words: list[str]) -> list[str]:
    p, chain, errors = cli_parser(), ["relayrl"], []
    rest = iter(words)
    for word in rest:
        subs = _subcommands(p)
        if not subs:
            rest = iter([word, *rest])
            break
        if word not in subs:
            if re.fullmatch(r"[a-z][a-z-]*", word):
                errors.append(f"no command {' '.join([*chain, word])}")
            return errors
        p = subs[word]
        chain.append(word)
    options = {o for action in p._actions for o in action.option_strings}
    for word in rest:
        flag = word.split("=")[0]
        if re.fullmatch(r"--[a-z][a-z0-9-]*[a-z0-9]", flag) and flag not in options:
            errors.append(f"{' '.join(chain)} has no {flag}")
    return errors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_documented_relayrl_command_and_flag_exists(page: Path) -> None:
    errors = [e for line in _command_lines(page) for e in _check_command(line.split())]
    assert not errors, sorted(set(errors))


def _config_keys(cls: type, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        keys.add(prefix + f.name)
        for tp in (hints[f.name], *typing.get_args(hints[f.name])):
            if dataclasses.is_dataclass(tp) and isinstance(tp, type):
                keys |= _config_keys(tp, f"{prefix}{f.name}.")
    return keys


def _values_keys(values: Any, prefix: str = "") -> set[str]:
    if not isinstance(values, dict):
        return set()
    return {k for name, v in values.items() for k in (prefix + name, *_values_keys(v, f"{prefix}{name}."))}


def _schema_keys(schema: dict[str, Any], prefix: str = "") -> set[str]:
    return {
        k
        for name, sub in schema.get("properties", {}).items()
        for k in (prefix + name, *_schema_keys(sub, f"{prefix}{name}."))
    }


CONFIG_KEYS = _config_keys(RunConfig)
CHART = REPO / "charts" / "relayrl"
VALUES_KEYS = _values_keys(yaml.safe_load((CHART / "values.yaml").read_text())) | _schema_keys(
    json.loads((CHART / "values.schema.json").read_text())
)
SECTIONS = {k for k in CONFIG_KEYS if "." not in k}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_documented_config_or_chart_key_exists(page: Path) -> None:
    keys = {
        m.group(1)
        for code in _all_code(page)
        for m in re.finditer(r"(?<![\w./-])([a-z_]+(?:\.[a-z_0-9]+)+)(?=[\s=:`,)]|$)", code)
    }
    wanted = {k for k in keys if k.partition(".")[0] in SECTIONS and not k.endswith(FILE_SUFFIXES)}
    unknown = wanted - CONFIG_KEYS - VALUES_KEYS - set(NOT_REFERENCES)
    assert not unknown, sorted(unknown)


def _config_blocks(page: Path) -> list[dict[str, Any]]:
    """The page's YAML run configs, and the `config:` of its chart values (with the world size the chart sets)."""
    found = []
    for block in re.findall(r"```ya?ml\n(.*?)```", page.read_text(), re.S):
        data = yaml.safe_load(block)
        if not isinstance(data, dict):
            continue
        if set(data) <= SECTIONS:
            found.append(data)
        elif isinstance(data.get("config"), dict):
            cfg, trainer = dict(data["config"]), data.get("trainer", {})
            world = trainer.get("nodes", 1) * trainer.get("nprocPerNode", 1)
            section = cfg.setdefault("trainer", {}).setdefault("distributed", {})
            section.setdefault("world_size", world)
            found.append(cfg)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_documented_config_snippet_loads(page: Path, tmp_path: Path) -> None:
    for i, data in enumerate(_config_blocks(page)):
        path = tmp_path / f"snippet{i}.yaml"
        path.write_text(yaml.safe_dump(data))
        load_run_config(path)  # a ConfigError names the field, the value and the rule


def _path_exists(path: str) -> bool:
    return bool(list(REPO.glob(path))) if "*" in path else (REPO / path).exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_documented_repository_path_exists(page: Path) -> None:
    top = r"(?:src|tests|examples|bench|scripts|charts|docs|protos|\.ci)"
    paths = {
        m.group(1).split("::")[0]
        for code in _all_code(page)
        for m in re.finditer(rf"(?<![\w./-])({top}/[\w./*-]*[\w*])", code)
    }
    missing = {p for p in paths if not _path_exists(p)} - set(NOT_REFERENCES)
    assert not missing, sorted(missing)


def _module_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        name = ".".join(parts[:n])
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            obj: Any = importlib.import_module(name)
            for attr in parts[n:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


PROTO_PACKAGES = {
    m.group(1)
    for proto in (REPO / "protos").rglob("*.proto")
    for m in re.finditer(r"^package ([\w.]+);", proto.read_text(), re.M)
}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_documented_module_exists(page: Path) -> None:
    names = {m.group(1) for code in _all_code(page) for m in re.finditer(r"(?<![\w./-])(relayrl(?:\.\w+)+)", code)}
    unknown = {
        n
        for n in names
        if n not in ENTRY_POINT_GROUPS
        and n.rpartition(".")[0] not in PROTO_PACKAGES
        and n not in PROTO_PACKAGES
        and not _module_exists(n)
    }
    assert not unknown - set(NOT_REFERENCES), sorted(unknown)


EXPORTED = exported_names()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_documented_metric_is_exported(page: Path) -> None:
    names = {
        m.group(1)
        for code in _all_code(page)
        for m in re.finditer(r"\b(relayrl_(?:inference|reward|rollout|trainer)_\w*[a-z])\b", code)
    }
    assert not names - EXPORTED, sorted(names - EXPORTED)
