"""The configured workflow (rollout.workflow): a built-in one or a user's, loaded at start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from relayrl.common.dataset import Prompt
from relayrl.common.plugins import load_callable
from relayrl.config.rollout import RolloutConfig, ToolFormat
from relayrl.config.typed import ConfigError
from relayrl.rollout.workflows.agent import AgentWorkflow
from relayrl.rollout.workflows.api import (
    ENTRY_POINT_GROUP,
    ENVIRONMENT_ENTRY_POINT_GROUP,
    Environment,
    EnvironmentFactory,
    Workflow,
)
from relayrl.rollout.workflows.multi_turn import MultiTurnWorkflow
from relayrl.rollout.workflows.single_turn import SingleTurnWorkflow
from relayrl.rollout.workflows.tools import ToolEnvironment, ToolSet


def build_workflow(
    cfg: RolloutConfig, model_path: Path | None = None, reward: Any = None
) -> tuple[Workflow, EnvironmentFactory | None]:
    """The workflow of ``cfg`` and the environment factory it plays (multi_turn only); a ConfigError names the
    field that cannot be loaded. The agent workflow renders conversations with the served model's tokenizer
    (``model_path``, the run's model.path). Tools that run code (the ``python`` tool) run it through ``reward``'s
    RunCode (a RewardClient holding the code token)."""
    if cfg.workflow == "single_turn":
        return SingleTurnWorkflow(), None
    if cfg.workflow == "multi_turn":
        factory = cast(
            EnvironmentFactory, load_callable(cfg.environment, ENVIRONMENT_ENTRY_POINT_GROUP, "rollout.environment")
        )
        return MultiTurnWorkflow(factory), factory
    if cfg.workflow == "tools":
        tokenizer = None
        if cfg.tool_format == ToolFormat.HERMES and model_path is not None:  # tool results in the template's turns
            from relayrl.common.model import load_tokenizer

            tokenizer = load_tokenizer(model_path)
        tools = ToolSet.from_specs(cfg.tools, cfg.tool_format, cfg.tool_timeout_s, reward, tokenizer)

        def environment(row: Prompt) -> Environment:
            return ToolEnvironment(tools, cfg.max_tool_calls)

        return MultiTurnWorkflow(environment, score=True, stop=tools.stops(), answer=tools.answer), environment
    if cfg.workflow == "agent":
        if model_path is None:
            raise ConfigError("model.path", model_path, "the agent workflow needs the served model's tokenizer")
        return AgentWorkflow.from_config(cfg.agent, cfg, model_path), None
    plugin_env = (
        cast(EnvironmentFactory, load_callable(cfg.environment, ENVIRONMENT_ENTRY_POINT_GROUP, "rollout.environment"))
        if cfg.environment
        else None
    )
    return cast(Workflow, load_callable(cfg.workflow, ENTRY_POINT_GROUP, "rollout.workflow")), plugin_env
