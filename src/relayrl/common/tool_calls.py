"""Tool calls in model output, Hermes convention (Qwen2.5, SmolLM2/3, Hermes and most templates that render
``tools``): each call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>`` tags. Pure functions (no torch, no service): the inference REST API and rollout both use them.

A tag whose body is not such an object is left in the text (the model's output is never silently dropped).

:func:`tool_turn_text` renders tool results the way a model's chat template renders tool messages (Qwen2.5/Hermes:
``<|im_end|>\n<|im_start|>user\n<tool_response>\n...\n</tool_response><|im_end|>\n<|im_start|>assistant\n``), so
that a multi-turn episode can append them after the model's own tokens without re-rendering earlier turns.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_CALL = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's ``function.arguments``)
    id: str = ""

    def openai(self, index: int | None = None) -> dict[str, object]:
        """The call as an OpenAI ``tool_calls`` entry (with ``index`` for a streamed delta)."""
        out: dict[str, object] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def _parse_one(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments already encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split model output into (the text outside well-formed tool-call tags, stripped; the calls in order)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _CALL.finditer(text):
        call = _parse_one(m.group(1).strip())
        if call is None:
            continue  # malformed: stays in the text
        kept.append(text[pos : m.start()])
        calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept).strip() if calls else text, calls


def render_tool_call(name: str, arguments: str | dict[str, object]) -> str:
    """A call as the model writes it (for prompts that replay an assistant's earlier calls)."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE_TAG}"


_TURN_MARK = "\x00relayrl-assistant-turn\x00"  # stands for the model's turn: no template writes it


def tool_turn_text(apply_chat_template: Callable[..., Any], outputs: Sequence[str]) -> str | None:
    """What a chat template writes between an assistant turn's text and the next assistant turn's text when tool
    messages with ``outputs`` follow it: the end of the assistant turn, the tool messages, the next assistant
    header. ``apply_chat_template`` is a tokenizer's. None when the template cannot say (it raises on tool
    messages, or does not write the assistant's content or an output verbatim): the caller keeps its own format."""
    messages = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": _TURN_MARK},
        *({"role": "tool", "content": out} for out in outputs),
    ]
    try:
        text = str(apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    except Exception:  # a template that refuses tool messages (or this shape of conversation)
        return None
    at = text.find(_TURN_MARK)
    if at < 0:
        return None
    rest = text[at + len(_TURN_MARK) :]
    pos = 0
    for out in outputs:  # each output, verbatim and in order
        found = rest.find(out, pos)
        if found < 0:
            return None
        pos = found + len(out)
    return rest


def chat_template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template (its default one, or a named ``tool_use`` one); "" when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else ""


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads a ``tools`` variable: only then does
    ``apply_chat_template(..., tools=...)`` show the tools to the model."""
    return "tools" in chat_template_text(tokenizer)
