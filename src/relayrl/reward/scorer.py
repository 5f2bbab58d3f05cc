"""The configured reward as one callable: a single function, or weighted components reported by name."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field, replace
from string import Template
from typing import Any

from relayrl.config.reward import CodeVerifierConfig, RewardConfig
from relayrl.config.typed import ConfigError
from relayrl.reward.api import (
    RewardFn,
    RewardFunctionError,
    RewardInput,
    RewardResult,
    bind_params,
    executes_code,
    is_batched,
    load_reward_function,
    normalize_result,
    registered_rewards,
    wants_keyword,
    wants_sandbox,
)
from relayrl.reward.sandbox import Sandbox


@dataclass(frozen=True)
class ComponentSpec:
    name: str
    function: str
    weight: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScorerSpec:
    """Picklable description of the reward, sent to each worker process, which imports the functions itself."""

    function: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    components: tuple[ComponentSpec, ...] = ()
    code: CodeVerifierConfig = field(default_factory=CodeVerifierConfig)  # reward.code, for the code verifier

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> ScorerSpec:
        if cfg.components:
            return cls(
                components=tuple(ComponentSpec(c.name, c.function, c.weight, dict(c.params)) for c in cfg.components),
                code=cfg.code,
            )
        return cls(function=cfg.function, params=dict(cfg.params), code=cfg.code)

    def modules(self) -> list[str]:
        """Modules of the configured ``module:function`` specs (preloaded by the forkserver)."""
        specs = [c.function for c in self.components] if self.components else [self.function]
        registered = registered_rewards()
        return [registered.get(s, s).partition(":")[0] for s in specs if ":" in registered.get(s, s)]

    def describe(self) -> str:
        if not self.components:
            return self.function
        return " + ".join(f"{c.weight:g}*{c.name}({c.function})" for c in self.components)


def with_run_values(cfg: RewardConfig, values: dict[str, str]) -> RewardConfig:
    """``cfg`` with ``${name}`` in its string params replaced by ``values[name]`` (``${inference_url}``: the run's
    own inference's OpenAI-compatible base URL, for a judge)."""

    def fill(params: dict[str, Any]) -> dict[str, Any]:
        return {k: Template(v).safe_substitute(values) if isinstance(v, str) else v for k, v in params.items()}

    parts = [replace(c, params=fill(c.params)) for c in cfg.components]
    return replace(cfg, params=fill(cfg.params), components=parts)


def _load(
    function: str, params: dict[str, Any], field_name: str, sandbox: Sandbox | None, code: CodeVerifierConfig
) -> tuple[RewardFn, bool]:
    """The function of ``function`` with its ``params`` bound (and ``sandbox=``, ``code_config=`` when it takes
    them), and whether it runs code."""
    fn = load_reward_function(function, f"{field_name}.function")
    injected: dict[str, Any] = {}
    if wants_keyword(fn, "code_config"):
        injected["code_config"] = code
    if wants_sandbox(fn):
        if sandbox is None:
            raise ValueError(f"{function} runs code in a sandbox: create the Scorer with one")
        injected["sandbox"] = sandbox
    clash = sorted(set(injected) & set(params))
    if clash:
        raise ConfigError(
            f"{field_name}.params",
            dict(params),
            f"`{clash[0]}` is not a parameter: the service gives it (reward.sandbox, reward.code)",
        )
    return bind_params(fn, {**params, **injected}, f"{field_name}.params"), executes_code(fn)


class Scorer:
    """Loads the functions of a spec (errors are ConfigErrors naming the field) and scores one input.

    The total of a composite reward is sum(weight x score); ``components`` holds each component's unweighted
    score under its name and its own components as ``name.sub``. A component that fails fails the whole call.
    Async functions run to completion on this scorer's event loop (one per verifier process).

    ``sandbox`` is passed to the functions that take a keyword-only ``sandbox`` parameter (the ``code``
    verifier); a spec with such a function needs one. ``runs_code``: some function runs programs
    (:func:`relayrl.reward.api.executes_code`)."""

    def __init__(self, spec: ScorerSpec, sandbox: Sandbox | None = None) -> None:
        self.spec = spec
        self.sandbox = sandbox
        self._loop: asyncio.AbstractEventLoop | None = None
        loaded = (
            [
                (c.name, c.weight, _load(c.function, c.params, f"reward.components.{c.name}", sandbox, spec.code))
                for c in spec.components
            ]
            if spec.components
            else [("", 1.0, _load(spec.function, spec.params, "reward", sandbox, spec.code))]
        )
        self.parts: list[tuple[str, float, RewardFn]] = [(name, weight, fn) for name, weight, (fn, _) in loaded]
        self.runs_code = any(runs for _, _, (_, runs) in loaded)  # some part runs programs: calls need the code token
        self.batched = any(is_batched(fn) for _, _, fn in self.parts)  # some part scores a whole chunk at once

    def _resolve(self, value: Any) -> Any:
        """An async function's result, run to completion on this scorer's own loop; any other value as it is."""
        if inspect.isawaitable(value):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            value = self._loop.run_until_complete(value)
        return value

    def _call(self, fn: RewardFn, inp: RewardInput) -> RewardResult:
        return normalize_result(self._resolve(fn(inp)))

    def __call__(self, inp: RewardInput) -> RewardResult:
        result = self.score_many([inp])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def _part(self, fn: RewardFn, inputs: list[RewardInput]) -> list[RewardResult | BaseException]:
        """One part's results for ``inputs``: one call of a batched function, else one call per input."""
        if not is_batched(fn):
            out: list[RewardResult | BaseException] = []
            for inp in inputs:
                try:
                    out.append(self._call(fn, inp))
                except Exception as exc:
                    out.append(exc)
            return out
        try:
            values = self._call_batched(fn, inputs)
        except Exception as exc:  # the call failed: so did each of its inputs
            return [exc] * len(inputs)
        results: list[RewardResult | BaseException] = []
        for value in values:
            try:
                results.append(value if isinstance(value, BaseException) else normalize_result(value))
            except RewardFunctionError as exc:
                results.append(exc)
        return results

    def _call_batched(self, fn: RewardFn, inputs: list[RewardInput]) -> list[Any]:
        values = self._resolve(fn(inputs))  # type: ignore[arg-type]
        if not isinstance(values, list) or len(values) != len(inputs):
            got = f"{len(values)} results" if isinstance(values, list) else type(values).__name__
            raise RewardFunctionError(f"a batched reward function returned {got} for {len(inputs)} inputs")
        return values

    def score_many(self, inputs: list[RewardInput]) -> list[RewardResult | BaseException]:
        """The result of each input, or the exception that makes it an ERROR; a composite's total is
        sum(weight x score), and a component that fails fails that input."""
        if not self.spec.components:
            return self._part(self.parts[0][2], inputs)
        per_part = [(name, weight, self._part(fn, inputs)) for name, weight, fn in self.parts]
        out: list[RewardResult | BaseException] = []
        for i in range(len(inputs)):
            total, components, details = 0.0, dict[str, float](), list[str]()
            failed: BaseException | None = None
            for name, weight, results in per_part:
                result = results[i]
                if isinstance(result, BaseException):
                    failed = RewardFunctionError(f"component {name!r} failed: {type(result).__name__}: {result}")
                    break
                total += weight * result.score
                components[name] = result.score
                components.update({f"{name}.{k}": v for k, v in result.components.items()})
                if result.details:
                    details.append(f"{name}: {result.details}")
            out.append(failed or RewardResult(score=total, components=components, details="; ".join(details)))
        return out

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
