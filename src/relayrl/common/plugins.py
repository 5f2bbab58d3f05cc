"""Loading user code named in the config: ``package.module:function``, or the name of an entry point that an
installed package registers (rewards, workflows, environments, tools, agents). Errors are ConfigErrors that name the
config field."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from typing import Any

from relayrl.config.typed import ConfigError


def registered(group: str) -> dict[str, str]:
    """Entry-point name -> ``module:function`` of every entry point of ``group`` in the installed packages."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}


def load_callable(spec: str, group: str, field_name: str, registered_as: str = "") -> Callable[..., Any]:
    """Import ``module:function``, or the entry point ``spec`` of ``group``. ``registered_as`` words the second form
    in errors (default: "registered under <group>")."""
    if ":" not in spec:
        names = registered(group)
        if spec not in names:
            what = registered_as or f"registered under {group}"
            raise ConfigError(
                field_name,
                spec,
                f"must look like package.module:function or be {what} ({', '.join(sorted(names)) or 'none installed'})",
            )
        spec = names[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(field_name, spec, "must look like package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(field_name, spec, f"module cannot be imported ({exc})") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(field_name, spec, f"{module_name} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]
