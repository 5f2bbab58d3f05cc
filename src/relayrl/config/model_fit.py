"""The run's length limits against the model they serve and train: checked once, at start-up, where the model's
facts enter (its config.json: :meth:`relayrl.config.model.ModelConfig.facts`), by `relayrl run` before any service
starts and by each service at its own start.

A limit set above what the model can hold is refused with a ConfigError naming the field, its value and the
model's bound (a prompt of ``inference.max_prompt_tokens`` tokens must leave room for one new token in the context,
a probe sequence must fit it, ``rollout.top_k`` must not exceed the vocabulary); a field left at its default (a
general cap, e.g. 2048 prompt tokens) is lowered to the model's bound instead, and the lowered value is what the
resolved config (``config.yaml``) then holds.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, replace
from typing import Any

from relayrl.config.inference import EngineKind
from relayrl.config.model import ModelFacts
from relayrl.config.run import RunConfig
from relayrl.config.typed import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Bound:
    path: str  # dotted field under the run config
    bound: int
    rule: str  # "must be <= {bound}: ..."


def _bounds(cfg: RunConfig, facts: ModelFacts) -> list[_Bound]:
    out: list[_Bound] = []
    context, where = facts.context_length, f"{facts.context_key} in {facts.source}"
    if cfg.inference.engine is EngineKind.VLLM and cfg.inference.vllm.max_model_len > 0:
        context, where = cfg.inference.vllm.max_model_len, "inference.vllm.max_model_len"
    if context is not None:
        room = f"the model's context length {context} ({where}) less one token"
        out += [
            _Bound("inference.max_prompt_tokens", context - 1, f"{room}: a prompt leaves room for one new token"),
            _Bound("inference.max_new_tokens_limit", context - 1, f"{room}: new tokens follow a prompt"),
            _Bound("rollout.max_new_tokens", context - 1, f"{room}: new tokens follow a prompt"),
            _Bound(
                "trainer.publication.probe_tokens",
                context,
                f"the model's context length {context} ({where}): each probe sequence is scored whole",
            ),
        ]
        if cfg.rollout.multi_turn:
            out.append(_Bound("rollout.max_episode_tokens", context - 1, f"{room}: an episode follows its prompt"))
    if facts.vocab_size is not None:
        out.append(
            _Bound(
                "rollout.top_k",
                facts.vocab_size,
                f"the model's vocabulary of {facts.vocab_size} tokens (vocab_size in {facts.source})",
            )
        )
    return out


def _field(obj: Any, name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(obj) if f.name == name)


def _with(obj: Any, path: list[str], value: int) -> Any:
    """``obj`` (a dataclass) with the field at ``path`` set to ``value``, every section on the way copied."""
    head, *rest = path
    return replace(obj, **{head: _with(getattr(obj, head), rest, value) if rest else value})


def fit_to_model(cfg: RunConfig, facts: ModelFacts | None = None) -> RunConfig:
    """``cfg`` with its length limits within the model (``facts``, else read from ``model.path``; nothing to check
    without a config.json). ConfigError for a limit set above the model's bound; a limit at its default is lowered
    to the bound."""
    facts = facts if facts is not None else cfg.model.facts()
    if facts is None:
        return cfg
    for b in _bounds(cfg, facts):
        *sections, name = b.path.split(".")
        owner: Any = cfg
        for s in sections:
            owner = getattr(owner, s)
        value = getattr(owner, name)
        if value <= b.bound:
            continue
        if value != _field(owner, name).default or b.bound < 1:
            raise ConfigError(b.path, value, f"must be <= {b.bound}: {b.rule}")
        log.info("%s lowered from its default %d to %d: %s", b.path, value, b.bound, b.rule)
        cfg = _with(cfg, b.path.split("."), b.bound)
    return cfg
