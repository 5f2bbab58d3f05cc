"""A tiny model that really calls a tool: a character-level Llama with a Hermes-style chat template (tools in
``<tools>``, calls as JSON in ``<tool_call>`` tags, results in ``<tool_response>``), fitted for a few seconds to
answer one question with a tool call and the tool's result with the answer. Greedy decoding then reproduces both
turns, so the API's tool-call path is tested on real generations."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model

TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{{ '\\n' }}"
    '{%- elif m.tool_calls %}assistant: {% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", '
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{{ '\\n' }}"
    "{%- else %}{{ m.role }}: {{ m.content }}{{ '\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}assistant: {% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "What is 1+2?"}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
CALLED = [
    *QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]
ANSWER = "It is 3."


def _turn(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the server hands them to the template (arguments decoded to a dict)."""
    import json

    out = []
    for m in msgs:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def create_tool_model(out: Path, steps: int = 100, lr: float = 5e-3) -> Path:
    from transformers import AutoTokenizer, LlamaForCausalLM

    chars = string.ascii_letters + string.digits + ' {}[]":,<>/_=+-*.;?\n'
    create_tiny_model(
        out,
        TinyModelConfig(
            chars=chars, hidden_size=128, intermediate_size=256, num_layers=2, max_position_embeddings=512, seed=3
        ),
    )
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = TEMPLATE
    model = LlamaForCausalLM.from_pretrained(str(out))
    pairs = [
        (tok.apply_chat_template(_turn(QUESTION), tools=TOOLS, add_generation_prompt=True, tokenize=False), CALL),
        (tok.apply_chat_template(_turn(CALLED), tools=TOOLS, add_generation_prompt=True, tokenize=False), ANSWER),
    ]
    rows = []
    for prompt, target in pairs:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        t = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((p + t, [-100] * len(p) + t))
    width = max(len(ids) for ids, _ in rows)  # one right-padded batch: one forward pass per step
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out
