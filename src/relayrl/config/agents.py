"""Configuration of black-box agent sessions (relayrl.rollout.workflows.agent): the agent function, where the
session proxy listens, and the limits of one session. Torch-free. The run config's ``rollout.agent`` section,
read by the agent workflow (``rollout.workflow: agent``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from relayrl.config.typed import ConfigError

FUNCTION_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class AgentReward(StrEnum):
    """Where a session's reward comes from."""

    AGENT = "agent"  # the agent function's return value; a session whose agent returns None is a reward error
    REWARD_SERVICE = "reward_service"  # the reward service scores the session's final answer
    AUTO = "auto"  # the agent's return value, or the reward service's score when it returns None


@dataclass
class AgentConfig:
    function: str = field(
        default="",
        metadata={
            "help": "The agent, as module:function: `async def agent(base_url: str, row: Prompt) -> float | None`. "
            "It talks to the model only through the OpenAI-compatible endpoint at base_url (one session)."
        },
    )
    reward: AgentReward = field(
        default=AgentReward.AUTO,
        metadata={
            "help": "Where a session's reward comes from: agent (its return value), reward_service (the reward "
            "service scores the last answer against the row's answer), auto (the agent's value, else the "
            "reward service)."
        },
    )
    host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "Interface the session proxy binds (loopback by default: session ids are its only credential)."
        },
    )
    port: int = field(
        default=0, metadata={"help": "Port of the session proxy (0: any free port).", "ge": 0, "le": 65535}
    )
    max_body_mib: int = field(
        default=4,
        metadata={"help": "Largest request body the proxy reads (MiB); a larger one gets 413.", "ge": 1, "le": 256},
    )
    max_calls: int = field(
        default=16, metadata={"help": "Chat completion calls one session may make; one more gets 413.", "ge": 1}
    )
    max_call_tokens: int = field(
        default=256,
        metadata={"help": "Tokens one call may generate at most (a call asking for more gets this many).", "ge": 1},
    )
    max_session_tokens: int = field(
        default=4096,
        metadata={"help": "Tokens one session may generate over all its calls; a call past it gets 413.", "ge": 1},
    )
    session_timeout_s: float = field(
        default=300.0,
        metadata={
            "help": "Wall time of one session: then the agent is cancelled, its session closed (later calls get 404) "
            "and its episodes marked TIMEOUT (excluded from the loss, counted).",
            "gt": 0,
        },
    )

    def validate(self) -> None:
        if self.function and not FUNCTION_SPEC.match(self.function):
            raise ConfigError("function", self.function, "must be module:function")
        if not self.host:
            raise ConfigError("host", self.host, "must not be empty")
        if self.max_call_tokens > self.max_session_tokens:
            raise ConfigError("max_call_tokens", self.max_call_tokens, "must be <= max_session_tokens")
