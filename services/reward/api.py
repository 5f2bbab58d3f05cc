"""The typed interface of reward functions, and loading one from ``module:function``.

A reward function takes a :class:`RewardInput` and returns a float or a :class:`RewardResult`; it may be
sync or async. Raising, or returning a non-finite score, is an error result, never a 0.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relayrl.common.config import ConfigError


@dataclass(frozen=True)
class RewardInput:
    prompt: str
    completion: str
    reference: str
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardResult:
    score: float
    components: Mapping[str, float] = field(default_factory=dict)
    details: str = ""


RewardFn = Callable[[RewardInput], float | RewardResult | Awaitable[float | RewardResult]]


class RewardFunctionError(RuntimeError):
    """The reward function returned something that is not a valid score."""


def load_reward_function(spec: str, field_name: str = "reward.function") -> RewardFn:
    """Import ``module:function``; errors name the config field."""
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


def normalize_result(value: Any) -> RewardResult:
    if isinstance(value, RewardResult):
        result = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        result = RewardResult(score=float(value))
    else:
        raise RewardFunctionError(f"reward function returned {type(value).__name__}, expected float or RewardResult")
    if not math.isfinite(result.score):
        raise RewardFunctionError(f"reward function returned a non-finite score {result.score}")
    for name, v in result.components.items():
        if not math.isfinite(float(v)):
            raise RewardFunctionError(f"component {name!r} is not finite: {v}")
    return result


def is_async(fn: RewardFn) -> bool:
    return inspect.iscoroutinefunction(fn)
