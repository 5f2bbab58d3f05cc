"""AgentWorkflow built from its config: the agent function named by ``rollout.agent.function``, sampling and limits
from the rollout section, and a name that is not an agent function refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.config.agents import AgentConfig
from relayrl.config.rollout import RolloutConfig
from relayrl.config.typed import ConfigError
from relayrl.rollout.workflows.agent import AgentWorkflow
from tests.integration.test_agent_sessions import multi_turn_agent


def test_workflow_from_config_loads_the_agent_function_and_refuses_a_bad_one(chat_model_dir: Path) -> None:
    rollout = RolloutConfig(temperature=0.7, max_new_tokens=32)
    spec = "tests.integration.test_agent_sessions:multi_turn_agent"

    workflow = AgentWorkflow.from_config(AgentConfig(function=spec), rollout, chat_model_dir)

    assert workflow.agent is multi_turn_agent
    assert workflow.sampling.temperature == 0.7 and workflow.limits.max_episode_tokens == 32
    with pytest.raises(ConfigError, match=r"rollout\.agent\.function"):
        AgentWorkflow.from_config(
            AgentConfig(function="tests.integration.test_agent_sessions:ROW"), rollout, chat_model_dir
        )
