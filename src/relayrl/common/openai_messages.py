"""The parts of OpenAI's chat message format that both OpenAI-compatible endpoints read (inference's API and
rollout's agent session endpoint): text content parts and the tool calls of assistant messages."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A request body part whose unknown keys are errors (a clear 400, never a silent drop)."""

    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """A tool call of an assistant message sent back in a conversation."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall
