"""The typed interface of reward functions, and loading one from ``module:function`` or an entry point.

A reward function takes a :class:`RewardInput` and returns a float or a :class:`RewardResult`; it may be
sync or async. Raising, or returning a non-finite score, is an error result, never a 0. Configured keyword
parameters are bound after the input: ``fn(inp, **params)``. A function that runs untrusted code declares a
keyword-only parameter ``sandbox``: the service passes it its :class:`relayrl.reward.sandbox.Sandbox` (built from
``reward.sandbox`` in each verifier process): ``fn(inp, *, sandbox, **params)``; one that also declares a
keyword-only ``code_config`` gets ``reward.code`` (:class:`relayrl.config.reward.CodeVerifierConfig`). A function
that runs programs (it takes the sandbox, or is decorated with :func:`runs_code`) makes every scoring call need
the code token.

Plugins: a package registers functions under the entry-point group ``relayrl.rewards``
(``[project.entry-points."relayrl.rewards"] my_reward = "my_pkg.rewards:score"``); the config then names them
by their entry-point name (``reward.function: my_reward``). relayrl's own verifiers are registered the same way.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from relayrl.common.plugins import load_callable, registered
from relayrl.config.typed import ConfigError


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


ENTRY_POINT_GROUP = "relayrl.rewards"


def registered_rewards() -> dict[str, str]:
    """Entry-point name -> ``module:function`` of every reward function registered by installed packages."""
    return registered(ENTRY_POINT_GROUP)


def load_reward_function(spec: str, field_name: str = "reward.function") -> RewardFn:
    """Import ``module:function``, or the entry point ``spec`` of group ``relayrl.rewards``; errors name the
    config field."""
    return load_callable(spec, ENTRY_POINT_GROUP, field_name, registered_as="a registered reward")


def bind_params(fn: RewardFn, params: Mapping[str, Any], field_name: str = "reward.params") -> RewardFn:
    """``fn`` with keyword ``params`` bound after the input; a parameter it does not take is a ConfigError."""
    if not params:
        return fn
    try:
        inspect.signature(fn).bind(None, **params)
    except TypeError as exc:
        raise ConfigError(
            field_name, dict(params), f"{getattr(fn, '__name__', fn)} does not accept them ({exc})"
        ) from None
    except ValueError:  # no signature (a builtin): let the call decide
        pass
    bound = functools.partial(fn, **params)
    functools.update_wrapper(bound, fn)
    return bound  # type: ignore[return-value]


def wants_keyword(fn: RewardFn, name: str) -> bool:
    """Whether ``fn`` has a keyword-only parameter ``name`` (one the service gives, not a configured param)."""
    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):  # no signature (a builtin)
        return False
    return param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY


def wants_sandbox(fn: RewardFn) -> bool:
    """Whether ``fn`` takes the service's sandbox: it has a keyword-only parameter named ``sandbox``."""
    return wants_keyword(fn, "sandbox")


RUNS_CODE = "relayrl_runs_code"  # the attribute by which a reward function declares that it runs programs
F = TypeVar("F", bound=Callable[..., Any])


def runs_code(fn: F) -> F:
    """Declare that the reward function ``fn`` executes programs (model-written code): the service then requires the
    code token (``control.code_token_env``) on every Score, ScoreBatch and ``POST /score`` call. A function that
    takes the service's ``sandbox`` counts as one without it; a plugin that runs code by other means must say so."""
    setattr(fn, RUNS_CODE, True)
    return fn


def executes_code(fn: RewardFn) -> bool:
    """Whether ``fn`` runs programs: it takes the sandbox, or is declared with :func:`runs_code` (also through a
    ``functools.partial`` or a wrapper that keeps ``__wrapped__``)."""
    target: Any = fn
    for _ in range(16):
        if wants_sandbox(target) or getattr(target, RUNS_CODE, False) is True:
            return True
        target = target.func if isinstance(target, functools.partial) else getattr(target, "__wrapped__", None)
        if target is None:
            return False
    return False


def normalize_result(value: Any) -> RewardResult:
    """A valid result with plain float components and string details, or RewardFunctionError."""
    if isinstance(value, RewardResult):
        result = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        result = RewardResult(score=float(value))
    else:
        raise RewardFunctionError(f"reward function returned {type(value).__name__}, expected float or RewardResult")
    try:
        score = float(result.score)
        components = {str(k): float(v) for k, v in result.components.items()}
    except (TypeError, ValueError) as exc:
        raise RewardFunctionError(f"reward function returned a non-numeric score or component: {exc}") from None
    if not math.isfinite(score):
        raise RewardFunctionError(f"reward function returned a non-finite score {score}")
    for name, v in components.items():
        if not math.isfinite(v):
            raise RewardFunctionError(f"component {name!r} is not finite: {v}")
    return RewardResult(score=score, components=components, details=str(result.details))


BATCHED = "relayrl_batched"  # the attribute by which a reward function declares that it scores a list at once


def batched(fn: F) -> F:
    """Declare that the reward function ``fn`` takes a list of inputs and returns one result per input, in order:
    a float, a :class:`RewardResult`, or an exception (that input's ERROR result). The verifier process then
    hands it each chunk of a batch (``reward.chunk_size`` inputs) in one call: a model scores them together."""
    setattr(fn, BATCHED, True)
    return fn


def is_batched(fn: RewardFn) -> bool:
    """Whether ``fn`` is declared with :func:`batched` (also through a ``functools.partial``)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(target, BATCHED, False) is True


def is_async(fn: RewardFn) -> bool:
    target = fn.func if isinstance(fn, functools.partial) else fn
    return inspect.iscoroutinefunction(target)
