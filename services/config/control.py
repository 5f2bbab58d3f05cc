"""The control section: the bearer token of mutating control calls."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class ControlConfig:
    token_env: str = field(default="RELAYRL_CONTROL_TOKEN", metadata={
        "help": "Environment variable holding the bearer token required by mutating control calls."})
    token: str = field(default="", metadata={
        "help": "Bearer token when the environment variable is unset (empty: control calls are open; keep the "
                "ports private then).", "secret": "value"})

    def effective_token(self) -> str:
        return os.environ.get(self.token_env, "") or self.token
