"""Typed configuration: dataclasses validated at start-up.

Each component declares its own dataclass beside its code; the run config composes them. Values come from
YAML files plus ``--set section.key=value`` overrides (read by :mod:`relayrl.config.sources`). Every error names
the field, the value and the rule.

Field constraints live in ``dataclasses.field(metadata=...)``: ``help`` (documentation), ``ge``/``gt``/
``le``/``lt`` (numeric bounds). Finite choices are ``Literal`` or ``Enum`` types. A dataclass may define
``validate(self)`` for rules that relate several fields; it raises :class:`ConfigError`.

Compatibility: a field being phased out keeps loading and carries ``deprecated`` (what to use instead) and
``removed_in`` (the release that removes it) in its metadata; setting it logs a warning naming both. A removed
field is listed in the dataclass's ``REMOVED_FIELDS`` (name → migration hint) and fails with that hint. A field
that moved into a nested section is listed in ``MOVED_FIELDS`` (old name → dotted path of its field now, below
the same dataclass; ``MOVED_REMOVED_IN`` names the release that stops accepting the old name): the old key keeps
loading onto the new field with a warning naming the new key, and setting both is an error. Any other unknown
key fails (no silent typos).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import operator
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")

REDACTED = "***"  # what an error or a view shows instead of a secret value

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """An invalid configuration value: names the field, the value and the rule it breaks."""

    def __init__(self, field: str, value: Any, rule: str, *, secret: bool = False) -> None:
        self.field = field
        self.value = REDACTED if secret else value
        self.rule = rule
        self.secret = secret
        shown = REDACTED if secret else repr(value)
        super().__init__(f"invalid config: {field} = {shown}: {rule}")

    def redacted(self) -> ConfigError:
        """The same error without its value (for a field that holds a secret)."""
        return ConfigError(self.field, None, self.rule, secret=True)


def describe(field: dataclasses.Field[Any]) -> str:
    return str(field.metadata.get("help", ""))


def _type_name(tp: Any) -> str:
    if get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as exc:
                errors.append(exc.rule)
        raise ConfigError(path, value, " or ".join(errors))
    if origin is typing.Literal:
        if value not in get_args(tp):
            raise ConfigError(path, value, f"must be {_type_name(tp)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(path, value, "must be a list")
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, value, "must be a mapping")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {_convert(key_tp, k, path): _convert(val_tp, v, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, typing.cast(type, tp)):
            return value
        if not isinstance(value, dict):
            raise ConfigError(path, value, "must be a mapping (a config section)")
        return from_dict(typing.cast(type, tp), value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(path, value, f"must be {_type_name(tp)}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, value, "must be a number")
        if not math.isfinite(value):  # .inf would pass every bound check, .nan fails none
            raise ConfigError(path, value, "must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "must be a string")
        return value
    if tp is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(path, value, "must be a path")
        return Path(value)
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def _check_bounds(field: dataclasses.Field[Any], value: Any, path: str) -> None:
    if value is None:
        return
    meta = field.metadata
    # int and float compare exactly in Python, also an int too large for a float (float() would overflow)
    for key, op, word in (
        ("ge", operator.ge, ">="),
        ("gt", operator.gt, ">"),
        ("le", operator.le, "<="),
        ("lt", operator.lt, "<"),
    ):
        if key in meta and not op(value, meta[key]):
            raise ConfigError(path, value, f"must be {word} {meta[key]}")


def field_at(cls: type, dotted: str) -> dataclasses.Field[Any]:
    """The field of a dataclass tree at a dotted path below ``cls``."""
    *sections, leaf = dotted.split(".")
    for name in sections:
        cls = get_type_hints(cls)[name]
    return {f.name: f for f in dataclasses.fields(cls)}[leaf]


def _field_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _move_fields(cls: type, data: dict[str, Any], path: str) -> dict[str, Any]:
    """Put each old key of ``cls.MOVED_FIELDS`` found in ``data`` at its nested path (warning; both: an error)."""
    moved: dict[str, str] = getattr(cls, "MOVED_FIELDS", {})
    if not any(key in moved for key in data):
        return data
    data = dict(data)
    for key in [k for k in data if k in moved]:
        value = data.pop(key)
        where = f"{path}.{key}" if path else key
        new = f"{path}.{moved[key]}" if path else moved[key]
        *sections, leaf = moved[key].split(".")
        node = data
        for name in sections:
            child = node.get(name, {})
            if not isinstance(child, dict):
                raise ConfigError(new.rsplit(".", 1)[0], child, "must be a mapping (a config section)")
            node[name] = node = dict(child)
        if leaf in node:
            raise ConfigError(where, value, f"set twice: {where} is the deprecated spelling of {new}; keep only {new}")
        node[leaf] = value
        if value != _field_default(field_at(cls, moved[key])):  # a resolved old config.yaml: defaults, no warning
            log.warning(
                "config field %s is deprecated (use %s) and will be removed in release %s",
                where,
                new,
                getattr(cls, "MOVED_REMOVED_IN", "?"),
            )
    return data


def from_dict(cls: type[T], data: dict[str, Any], path: str = "", base: Any = None) -> T:
    """Build and validate ``cls`` from a mapping; unknown keys are errors (no silent typos). Keys the mapping leaves
    out take ``base``'s values when given, else the fields' defaults. A nested section given in part keeps the
    values of its owner's default for it (``server: {reflection: false}`` keeps inference's port and limits, which
    its ``default_factory`` sets, rather than resetting them to ServerConfig's class defaults)."""
    if not isinstance(data, dict):
        raise ConfigError(path or "<root>", data, "must be a mapping")
    data = _move_fields(cls, data, path)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    removed: dict[str, str] = getattr(cls, "REMOVED_FIELDS", {})
    for key in data:
        if not isinstance(key, str):  # YAML allows any key (`?` alone is the key null)
            raise ConfigError(
                f"{path}.{key!r}" if path else repr(key), None, "field names must be strings", secret=True
            )
        where = f"{path}.{key}" if path else key
        if key in removed:
            raise ConfigError(where, data[key], f"this field was removed: {removed[key]}")
        if key not in fields:  # the value is not shown: a mistyped key may hold a secret
            raise ConfigError(where, None, f"unknown field; known fields: {', '.join(fields)}", secret=True)
        note = fields[key].metadata.get("deprecated")
        if note and data[key] != fields[key].default:  # a resolved config.yaml carries the default: no warning
            log.warning(
                "config field %s is deprecated (%s) and will be removed in release %s",
                where,
                note,
                fields[key].metadata.get("removed_in", "?"),
            )
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        where = f"{path}.{name}" if path else name
        if name in data:
            try:
                value = _section(hints[name], field, data[name], where, base)
                if value is None:
                    value = _convert(hints[name], data[name], where)
                _check_bounds(field, value, where)
            except ConfigError as exc:
                raise (exc.redacted() if field.metadata.get("secret") else exc) from None
            kwargs[name] = value
        elif base is not None:
            kwargs[name] = getattr(base, name)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(where, None, "required field is missing")
    obj = cls(**kwargs)
    validate_tree(obj, path)
    return obj


def _section(tp: Any, field: dataclasses.Field[Any], value: Any, path: str, base: Any) -> Any:
    """A nested section given as a mapping, built over the default it replaces (None: not such a section)."""
    if not (dataclasses.is_dataclass(tp) and isinstance(value, dict)):
        return None
    default = getattr(base, field.name) if base is not None else _field_default(field)
    if not dataclasses.is_dataclass(default):
        return None
    return from_dict(typing.cast(type, tp), value, path, base=default)


def validate_tree(obj: Any, path: str = "") -> None:
    """Run bounds checks and ``validate()`` hooks on ``obj`` (also for objects built in code)."""
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        where = f"{path}.{field.name}" if path else field.name
        _check_bounds(field, value, where)
    hook = getattr(obj, "validate", None)
    if callable(hook):
        try:
            hook()
        except ConfigError as exc:
            secrets = {f.name for f in dataclasses.fields(obj) if f.metadata.get("secret")}
            secret = exc.secret or exc.field.rsplit(".", 1)[-1] in secrets
            if path and not exc.field.startswith(path):
                raise ConfigError(f"{path}.{exc.field}", exc.value, exc.rule, secret=secret) from None
            raise (exc.redacted() if secret else exc) from None


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config (enums as values, paths as strings), for YAML dumps."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
