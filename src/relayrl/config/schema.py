"""The public config schema as plain data, its Markdown reference, and compatibility between two schemas.

``schema(RunConfig)`` flattens the dataclasses into ``{"section.field": {"type", "default", "choices", "help",
...}}``; a key listed in a dataclass's ``MOVED_FIELDS`` appears as its own entry with ``moved_to`` (the field
it now sets) and the target's type, choices and bounds, so moving a key with its deprecation is compatible.
:func:`incompatible_changes` lists what would break an existing user config between an old and a new schema: a
removed field (even one listed in ``REMOVED_FIELDS``: its hint helps, but the config no longer loads), a changed
type, narrowed choices, a tightened bound. Adding fields, widening choices, changing defaults
or help are compatible. ``scripts/gen_reference.py --check`` compares the committed snapshot
(docs/reference/config-schema.json) with the code and fails on any difference, naming the incompatible ones.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints


def _type(tp: Any) -> tuple[str, list[Any] | None]:
    origin = get_origin(tp)
    if origin is typing.Literal:
        return "choice", list(get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "choice", [m.value for m in tp]
    if origin in (typing.Union, types.UnionType):
        names = [_type(a)[0] for a in get_args(tp)]
        return " | ".join(names), None
    if origin in (list, tuple, dict):
        inner = ", ".join(_type(a)[0] for a in get_args(tp))
        return f"{origin.__name__}[{inner}]", None
    if tp is type(None):
        return "null", None
    return getattr(tp, "__name__", str(tp)), None


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def schema(cls: type, prefix: str = "") -> dict[str, dict[str, Any]]:
    """Every leaf field of a config dataclass tree, by dotted path."""
    out: dict[str, dict[str, Any]] = {}
    hints = get_type_hints(cls)
    instance = cls()
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(schema(typing.cast(type, tp), f"{path}."))
            continue
        kind, choices = _type(tp)
        entry: dict[str, Any] = {
            "type": kind,
            "default": _plain(getattr(instance, f.name)),
            "help": str(f.metadata.get("help", "")),
        }
        if choices is not None:
            entry["choices"] = choices
        for key in ("ge", "gt", "le", "lt", "deprecated", "removed_in"):
            if key in f.metadata:
                entry[key] = f.metadata[key]
        out[path] = entry
    removed_in = getattr(cls, "MOVED_REMOVED_IN", "?")
    for old, new in getattr(cls, "MOVED_FIELDS", {}).items():
        target = out[f"{prefix}{new}"]
        out[f"{prefix}{old}"] = {
            **{k: v for k, v in target.items() if k not in ("help", "deprecated")},
            "help": f"Former spelling of {prefix}{new}.",
            "moved_to": f"{prefix}{new}",
            "deprecated": f"use {prefix}{new}",
            "removed_in": removed_in,
        }
    return out


def incompatible_changes(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[str]:
    """Changes from ``old`` to ``new`` that can break a config valid under ``old``."""
    problems = []
    for path, before in sorted(old.items()):
        after = new.get(path)
        if after is None:
            problems.append(f"{path}: removed")
            continue
        if "moved_to" in after and after["moved_to"] not in new:
            problems.append(f"{path}: moved to {after['moved_to']}, which does not exist")
            continue
        if after["type"] != before["type"]:
            problems.append(f"{path}: type changed from {before['type']} to {after['type']}")
        dropped = [c for c in before.get("choices") or [] if c not in (after.get("choices") or [])]
        if dropped:
            problems.append(f"{path}: choices narrowed, {dropped} no longer accepted")
        for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if key in after and (
                key not in before or (after[key] > before[key] if key in ("ge", "gt") else after[key] < before[key])
            ):
                problems.append(f"{path}: bound tightened to {word} {after[key]}")
    return problems


def markdown(cls: type, title: str) -> str:
    """The configuration reference: one table per section."""
    rows = schema(cls)
    sections: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    moved = {path: e for path, e in rows.items() if "moved_to" in e}
    for path, entry in rows.items():
        if path in moved:
            continue
        section = path.rsplit(".", 1)[0] if "." in path else "(top level)"
        sections.setdefault(section, []).append((path, entry))
    lines = [
        f"# {title}",
        "",
        "Generated from the config dataclasses by `scripts/gen_reference.py`; do not edit.",
        "Every field can be set in the YAML run config or with `--set path=value`.",
        "",
    ]
    for section, entries in sections.items():
        lines += [f"## `{section}`", "", "| field | type | default | description |", "|---|---|---|---|"]
        for path, e in entries:
            kind = "one of " + ", ".join(f"`{c}`" for c in e["choices"]) if "choices" in e else f"`{e['type']}`"
            bounds = ", ".join(f"{w} {e[k]}" for k, w in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")) if k in e)
            help_text = e["help"].replace("|", "\\|") + (f" ({bounds})" if bounds else "")
            if "deprecated" in e:
                help_text = f"**Deprecated** ({e['deprecated']}; removed in {e.get('removed_in', '?')}). {help_text}"
            default = repr(e["default"]).replace("|", "\\|")
            lines.append(f"| `{path}` | {kind} | `{default}` | {help_text} |")
        lines.append("")
    if moved:
        lines += [
            "## Moved keys",
            "",
            "Former spellings that still load onto their new field, with a warning naming "
            "it; setting both is an error.",
            "",
            "| former key | now | removed in |",
            "|---|---|---|",
        ]
        lines += [f"| `{path}` | `{e['moved_to']}` | {e['removed_in']} |" for path, e in moved.items()]
        lines.append("")
    return "\n".join(lines)
