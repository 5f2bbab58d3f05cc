"""Tools for the built-in ``tools`` workflow: functions with a JSON schema, called by the model in its own format,
executed with a deadline; their output goes back to the model as observation tokens (loss mask 0).

Formats (rollout.tool_format): ``hermes`` parses ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` with
relayrl.common.tool_calls (the convention of the chat templates that render tools) and answers each call with
``<tool_response>...</tool_response>`` (a conversation prompt is rendered with the tools' JSON schemas when the chat
template renders tools: :meth:`ToolSet.prompt`); ``tagged`` is ``<name>argument text</name>``, answered
``<r>output</r>``: a plain format a tiny character-level model can learn. A tool is a function (sync or async) whose
keyword parameters are the call's arguments (tagged: one string parameter); its JSON schema is its ``schema``
attribute or is built from its signature. A failure (unknown tool, bad arguments, an exception, the deadline) is
shown to the model as the tool's output and counted on the episode (``tool_errors``), never hidden. A sync tool runs
in a thread; a tool that runs model-written code must not run here: it takes ``run_code`` and runs it in the reward
service's sandbox (code_tool.py; the built-in ``python`` tool does). A tool with a keyword-only parameter
``question`` gets the episode's prompt there from the environment, never from the model (an argument-free tool
bound to the episode, as relayrl.tasks.lookup's).
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import json
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relayrl.common.dataset import Prompt
from relayrl.common.plugins import load_callable
from relayrl.common.tool_calls import CLOSE_TAG, parse_tool_calls, template_renders_tools, tool_turn_text
from relayrl.config.rollout import ToolFormat
from relayrl.rollout.workflows.api import StepResult
from relayrl.rollout.workflows.code_tool import RUN_CODE, CodeRunner, takes_runner

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>\n"
TAGGED_OPEN, TAGGED_CLOSE = "<r>", "</r>"
MAX_OUTPUT_CHARS = 2000  # a tool's output beyond this is cut (and says so)
QUESTION = "question"  # the keyword-only parameter through which a tool gets the episode's prompt


def _keyword_only(fn: Callable[..., Any], name: str) -> bool:
    p = inspect.signature(fn).parameters.get(name)
    return p is not None and p.kind is p.KEYWORD_ONLY


def tool_schema(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    """``fn.schema`` if it has one, else an OpenAI function schema built from its signature and docstring."""
    given = getattr(fn, "schema", None)
    if isinstance(given, dict):
        return given
    props: dict[str, Any] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or (p.name in (RUN_CODE, QUESTION) and p.kind is p.KEYWORD_ONLY):
            continue
        ann = (
            p.annotation
            if not isinstance(p.annotation, str)
            else {"str": str, "int": int, "float": float, "bool": bool}.get(p.annotation, str)
        )
        props[p.name] = {"type": _JSON_TYPES.get(ann, "string")}
        if p.default is p.empty:
            required.append(p.name)
    return {
        "name": name,
        "description": inspect.getdoc(fn) or "",
        "parameters": {"type": "object", "properties": props, "required": required},
    }


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    bound: frozenset[str] = frozenset()  # keywords the workflow binds (run_code): never the model's arguments


class ToolSet:
    """``tokenizer`` (the served model's; hermes only): a chat episode's tool results are rendered as its chat
    template renders tool messages (:meth:`render`)."""

    def __init__(self, tools: Sequence[Tool], fmt: ToolFormat, timeout_s: float, tokenizer: Any = None) -> None:
        self.tools = {t.name: t for t in tools}
        self.fmt = fmt
        self.timeout_s = timeout_s
        self.tokenizer = tokenizer if fmt == ToolFormat.HERMES else None
        names = "|".join(re.escape(n) for n in self.tools)
        self._tagged = re.compile(rf"<({names})>(.*?)</\1>", re.DOTALL)

    @classmethod
    def from_specs(
        cls, specs: Sequence[str], fmt: ToolFormat, timeout_s: float, reward: Any = None, tokenizer: Any = None
    ) -> ToolSet:
        """The tools of ``specs``; one that takes ``run_code`` runs programs through ``reward`` (a RewardClient
        holding the code token) with the deadline ``timeout_s`` (code_tool.py)."""
        tools = []
        for spec in specs:
            fn = load_callable(spec, "relayrl.tools", "rollout.tools")
            name = str(getattr(fn, "tool_name", None) or getattr(fn, "__name__", spec.rpartition(":")[2]))
            if takes_runner(fn):
                runner = CodeRunner(reward, timeout_s)
                tools.append(
                    Tool(name, functools.partial(fn, run_code=runner), tool_schema(fn, name), frozenset({RUN_CODE}))
                )
            else:
                tools.append(
                    Tool(
                        name,
                        fn,
                        tool_schema(fn, name),
                        frozenset({QUESTION}) if _keyword_only(fn, QUESTION) else frozenset(),
                    )
                )
        return cls(tools, fmt, timeout_s, tokenizer)

    def prompt(self, conversation: list[dict[str, str]]) -> str | list[dict[str, str]]:
        """The first prompt of a chat episode. hermes with a template that renders tools: the conversation rendered
        once by the template with the tools' JSON schemas (``tools=``, OpenAI's function format) and the generation
        prompt, as text that inference tokenizes as is (its special tokens are the template's); otherwise the
        conversation itself, which inference renders without tools (the dataset's messages must describe them)."""
        if self.tokenizer is None or not template_renders_tools(self.tokenizer):
            return conversation
        tools = [{"type": "function", "function": t.schema} for t in self.tools.values()]
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    conversation, tools=tools, add_generation_prompt=True, tokenize=False
                )
            )
        except Exception:  # a template that refuses these messages: inference renders them (and says why)
            return conversation

    def stops(self) -> list[str]:
        """Stop strings that end a turn right after a call, so that the tool runs before the model goes on."""
        return [CLOSE_TAG] if self.fmt == ToolFormat.HERMES else [f"</{n}>" for n in self.tools]

    def parse(self, text: str) -> list[tuple[str, dict[str, Any] | str]]:
        """The calls in one model turn, in order: (tool name, arguments)."""
        if self.fmt == ToolFormat.TAGGED:
            return [(m.group(1), m.group(2)) for m in self._tagged.finditer(text)]
        return [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(text)[1]]

    def answer(self, text: str) -> str:
        """A turn's text outside its tool calls (the final answer of an episode)."""
        if self.fmt == ToolFormat.TAGGED:
            return self._tagged.sub("", text).strip()
        return parse_tool_calls(text)[0]

    async def call(self, name: str, args: dict[str, Any] | str, question: str = "") -> tuple[str, bool]:
        """(the output shown to the model, whether the call failed); ``question``: the episode's prompt, for a
        tool that takes it."""
        tool = self.tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}", True
        pos, kw = ((args,), {}) if isinstance(args, str) else ((), args)
        if tool.bound & set(kw):
            return f"error: {name} takes no argument {', '.join(sorted(tool.bound & set(kw)))}", True
        if QUESTION in tool.bound:
            kw = {**kw, QUESTION: question}
        try:
            inspect.signature(tool.fn).bind(*pos, **kw)  # wrong arguments: the model's error, shown to it
            run = (
                tool.fn(*pos, **kw) if inspect.iscoroutinefunction(tool.fn) else asyncio.to_thread(tool.fn, *pos, **kw)
            )
            result = await asyncio.wait_for(run, self.timeout_s)
        except TimeoutError:
            return f"error: {name} timed out after {self.timeout_s:g}s", True
        except Exception as exc:  # the model's arguments or the tool failed: the model reads why
            return f"error: {type(exc).__name__}: {exc}", True
        out = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        if len(out) > MAX_OUTPUT_CHARS:
            out = out[:MAX_OUTPUT_CHARS] + f"... [{len(out) - MAX_OUTPUT_CHARS} characters cut]"
        return out, False

    def render(self, outputs: Sequence[str], chat: bool = False) -> str:
        """The observation after a turn's calls. hermes in a chat episode (``chat``: the prompt was a conversation)
        with the model's tokenizer: the tool messages as its chat template renders them, with the end of the
        model's turn before them and the next assistant header after them (tool_turn_text); otherwise
        ``<tool_response>`` blocks (tagged: ``<r>`` blocks)."""
        if self.fmt == ToolFormat.TAGGED:
            return "".join(f"{TAGGED_OPEN}{o}{TAGGED_CLOSE}" for o in outputs)
        if chat and self.tokenizer is not None:
            text = tool_turn_text(self.tokenizer.apply_chat_template, outputs)
            if text is not None:
                return text
        return "".join(f"{RESPONSE_OPEN}{o}{RESPONSE_CLOSE}" for o in outputs)


class ToolEnvironment:
    """The environment of the ``tools`` workflow: the row's prompt; each turn with calls runs them and shows their
    outputs; a turn without a call is the answer (done). More than ``max_tool_calls`` calls in an episode end it
    (truncated, limit ``max_tool_calls``) without running the extra ones."""

    def __init__(self, tools: ToolSet, max_tool_calls: int) -> None:
        self.tools = tools
        self.max_tool_calls = max_tool_calls
        self.calls = 0
        self.chat = False  # the prompt is a conversation: tool results follow the chat template
        self.question = ""  # the row's prompt, for the tools that take it

    async def reset(self, row: Prompt, seed: int) -> str | list[dict[str, str]]:
        conversation = row.chat()
        self.chat = bool(conversation)
        self.question = row.prompt
        if not conversation:  # a plain text prompt (the tagged format's tiny models): as written
            return row.prompt
        return await asyncio.to_thread(self.tools.prompt, conversation)  # template rendering: off the loop

    async def step(self, action: str) -> StepResult:
        calls = self.tools.parse(action)
        if not calls:
            return StepResult("", done=True)
        if self.calls + len(calls) > self.max_tool_calls:
            return StepResult("", truncated=True, limit="max_tool_calls")
        self.calls += len(calls)
        results = [await self.tools.call(name, args, self.question) for name, args in calls]
        return StepResult(
            self.tools.render([out for out, _ in results], self.chat),
            tool_calls=len(calls),
            tool_errors=sum(failed for _, failed in results),
        )

    async def close(self) -> None:
        return None


_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)  # type: ignore[no-any-return]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))  # type: ignore[no-any-return]
    raise ValueError("not an arithmetic expression")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses), e.g. "12+35"."""
    if len(expression) > 200:
        raise ValueError("expression too long")
    value = _eval(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
