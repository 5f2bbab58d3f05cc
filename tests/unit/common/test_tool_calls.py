"""The Hermes-convention tool-call parser (relayrl.common.tool_calls)."""

from __future__ import annotations

import json

from relayrl.common.tool_calls import parse_tool_calls, render_tool_call


def test_calls_in_tags_are_parsed_in_order_and_removed_from_the_text() -> None:
    text = (
        'Let me check. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
        '<tool_call>\n{"name": "mul", "arguments": "{\\"b\\": 2}"}\n</tool_call>'
    )

    rest, calls = parse_tool_calls(text)

    assert rest == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1}), ("mul", {"b": 2})]
    assert len({c.id for c in calls}) == 2


def test_malformed_call_stays_in_the_text() -> None:
    text = '<tool_call>{"name": "add", "arguments": [1]}</tool_call> and <tool_call>not json</tool_call>'

    rest, calls = parse_tool_calls(text)

    assert calls == [] and rest == text


def test_rendered_call_parses_back() -> None:
    _, [call] = parse_tool_calls(render_tool_call("f", '{"x": [1, 2]}'))

    assert call.name == "f" and json.loads(call.arguments) == {"x": [1, 2]}
