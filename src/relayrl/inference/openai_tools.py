"""Chat prompts with tools, and tool calls in the answer (OpenAI chat API over a Hugging Face chat template).

Tools are rendered by the model's own chat template (``apply_chat_template(..., tools=...)``); a template that
never mentions ``tools`` cannot render them, and a request with tools (or with tool messages / earlier tool calls)
is refused with a 400 instead of silently dropping them. The answer's tool calls are parsed with the Hermes
convention (JSON in ``<tool_call>`` tags, :mod:`relayrl.common.tool_calls`), which is what templates that render
tools that way teach their models to emit. A tokenizer without any chat template gets ``"{role}: {content}\\n"``
per message followed by ``"assistant: "``.
"""

from __future__ import annotations

import json
from typing import Any

from relayrl.common.tool_calls import ToolCall, chat_template_text, parse_tool_calls, template_renders_tools
from relayrl.inference.openai_schema import ApiError, ChatMessage, ChatRequest


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template can render tools (it reads a ``tools`` variable)."""
    return template_renders_tools(tokenizer)


def uses_tools(req: ChatRequest) -> bool:
    """The request offers tools to the model (and does not turn them off with tool_choice='none')."""
    return bool(req.tools) and req.tool_choice != "none"


def _turn(m: ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        turn["name"] = m.name
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        turn["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": (
                        json.loads(c.function.arguments)
                        if isinstance(c.function.arguments, str)
                        else c.function.arguments
                    ),
                },
            }
            for c in m.tool_calls
        ]
    return turn


def chat_prompt(tokenizer: Any, req: ChatRequest) -> str:
    """The prompt text of a chat request; ApiError when it carries tools the template cannot render."""
    try:
        turns = [_turn(m) for m in req.messages]
    except json.JSONDecodeError as exc:
        raise ApiError(f"a tool call's function.arguments is not JSON: {exc}", "messages") from exc
    tool_turns = any(t["role"] == "tool" or "tool_calls" in t for t in turns)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if uses_tools(req) else None
    if (tools or tool_turns) and not renders_tools(tokenizer):
        param = "tools" if tools else "messages"
        raise ApiError(
            f"{param}: this model's chat template cannot render tools or tool messages (it never reads "
            "'tools'); serve a model whose template does, or leave them out",
            param,
        )
    if chat_template_text(tokenizer):
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        try:
            return str(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False, **kwargs))
        except Exception as exc:  # a template that raises on these messages (e.g. a role it does not allow)
            raise ApiError(f"the model's chat template refused these messages: {exc}", "messages") from exc
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant: "


def answer(text: str, with_tools: bool) -> tuple[dict[str, Any], list[ToolCall]]:
    """The assistant message of a choice (tool calls parsed out when tools were offered) and the calls."""
    calls: list[ToolCall] = []
    if with_tools:
        text, calls = parse_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    return message, calls
