"""The control section: the credentials of mutating calls (control calls, weight updates, code runs).

Credentials come from environment variables (preferred: they stay out of config files, command lines and logs),
else from the fields below. ``relayrl run`` generates both for every run and hands them to its services through
their environment; Docker Compose and Helm take them from a Secret. With no credential configured, the calls that
need it are refused (never open), and a service that listens beyond loopback refuses to start without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class ControlConfig:
    token_env: str = field(
        default="RELAYRL_CONTROL_TOKEN",
        metadata={
            "help": "Environment variable holding the bearer token of mutating control calls (pause/resume, "
            "checkpoint): what operators and `relayrl control` present."
        },
    )
    token: str = field(
        default="",
        metadata={
            "help": "Control token when the environment variable is unset (empty: control calls are refused).",
            "secret": "value",
        },
    )
    weights_token_env: str = field(
        default="RELAYRL_WEIGHTS_TOKEN",
        metadata={
            "help": "Environment variable holding the bearer token of weight updates: only the trainer and inference "
            "hold it, so only the trainer changes what inference serves."
        },
    )
    weights_token: str = field(
        default="",
        metadata={
            "help": "Weights token when the environment variable is unset (empty: weight updates are refused).",
            "secret": "value",
        },
    )
    code_token_env: str = field(
        default="RELAYRL_CODE_TOKEN",
        metadata={
            "help": "Environment variable holding the bearer token of the reward service's RunCode (a tool running "
            "model-written code in its sandbox): only rollout and reward hold it."
        },
    )
    code_token: str = field(
        default="",
        metadata={
            "help": "Code token when the environment variable is unset (empty: RunCode is refused).",
            "secret": "value",
        },
    )

    def effective_token(self) -> str:
        return os.environ.get(self.token_env, "") or self.token

    def effective_weights_token(self) -> str:
        return os.environ.get(self.weights_token_env, "") or self.weights_token

    def effective_code_token(self) -> str:
        return os.environ.get(self.code_token_env, "") or self.code_token
