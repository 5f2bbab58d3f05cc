"""Where a run config comes from: YAML files, ``--set section.key=value`` overrides (a former key's spelling
still applies to its field now, :func:`spellings`), and the digest check of a config a pod mounts. Every error
names the field, the value and the rule (:class:`relayrl.config.typed.ConfigError`, secret values redacted)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import typing
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from relayrl.config.typed import ConfigError

log = logging.getLogger(__name__)


def spellings(cls: type, dotted: str) -> tuple[str, list[str]]:
    """The current dotted path of a (possibly former) key below ``cls``, and the former spellings of that path
    (``MOVED_FIELDS`` at any level). Paths that name no field come back unchanged."""
    keys, current, canonical = dotted.split("."), cls, []
    while keys:
        key = keys.pop(0)
        moved: dict[str, str] = getattr(current, "MOVED_FIELDS", {})
        if key in moved:
            key, *rest = moved[key].split(".")
            keys = [*rest, *keys]
        canonical.append(key)
        hints = get_type_hints(current) if dataclasses.is_dataclass(current) else {}
        nxt = hints.get(key)
        if not keys or nxt is None or not dataclasses.is_dataclass(nxt):
            canonical += keys
            break
        current = typing.cast(type, nxt)
    path = ".".join(canonical)
    former: list[str] = []
    current = cls
    for i, key in enumerate(canonical):
        remainder = ".".join(canonical[i:])
        moved_here: dict[str, str] = getattr(current, "MOVED_FIELDS", {})
        former += [".".join([*canonical[:i], old]) for old, new in moved_here.items() if new == remainder]
        nxt = get_type_hints(current).get(key) if dataclasses.is_dataclass(current) else None
        if nxt is None or not dataclasses.is_dataclass(nxt):
            break
        current = typing.cast(type, nxt)
    return path, former


def _pop_path(data: dict[str, Any], dotted: str) -> None:
    *sections, leaf = dotted.split(".")
    node: Any = data
    for key in sections:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(leaf, None)


def apply_override(data: dict[str, Any], override: str, cls: type | None = None) -> None:
    """Apply one ``section.key=value`` override; the value is parsed as YAML (``3`` is an int). With ``cls`` (the
    config's dataclass) a former spelling of a moved field sets its current path (with a warning), and the
    override replaces the field whichever spelling the file used."""
    if "=" not in override:
        # the text is not shown: `control.token:abc` (a typo for `=`) holds a secret
        raise ConfigError("override", None, "an override must look like section.key=value", secret=True)
    dotted, raw = override.split("=", 1)
    dotted = dotted.strip()
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(
            dotted or "override", None, "an override key must be a dotted path such as trainer.total_steps", secret=True
        )
    if cls is not None:
        path, former = spellings(cls, dotted)
        if path != dotted:
            log.warning("config field %s is deprecated (use %s)", dotted, path)
        for alias in former:
            _pop_path(data, alias)
        keys = path.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(dotted, None, f"{key} is not a section", secret=True)
        node = child
    try:
        node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:  # the value is not shown: it may be a secret
        raise ConfigError(dotted, None, f"the value is not valid YAML ({_yaml_problem(exc)})", secret=True) from None


def load_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError("config", str(path), "config file does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("config", str(path), f"not valid YAML: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError("config", str(path), "the config file must hold a mapping at the top level")
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error as "line L, column C: problem" (1-based), without the offending text (it may be a secret)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or type(exc).__name__
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else str(problem)


CONFIG_DIGEST_ENV = "RELAYRL_CONFIG_SHA256"


def check_config_digest(path: Path) -> None:
    """When RELAYRL_CONFIG_SHA256 is set (the Helm chart sets it to the checksum of the config a pod was created
    for), the config file must still be that one (its text without trailing newlines): a Kubernetes ConfigMap volume
    is updated under running pods, so a restarted process would otherwise load a newer config than its peers."""
    expected = os.environ.get(CONFIG_DIGEST_ENV, "").strip().lower()
    if not expected:
        return
    actual = hashlib.sha256(path.read_text(encoding="utf-8").rstrip("\n").encode()).hexdigest()
    if actual != expected:
        raise ConfigError(
            CONFIG_DIGEST_ENV,
            expected,
            f"{path} has changed since this process's pod was created "
            f"(its sha256 is now {actual}): restart the pods so that they all load the new config",
        )
