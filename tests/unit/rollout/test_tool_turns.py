"""Tool results in a chat episode follow the model's chat template (Qwen2.5/Hermes: a ``user`` turn holding
``<tool_response>`` blocks between the turn markers), appended as token ids after the model's own tokens with loss
mask 0; earlier turns are never re-rendered. A real byte-level BPE tokenizer with ChatML special tokens, built
offline (tests/chat_model.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from relayrl.common.dataset import Prompt
from relayrl.common.model import chat_token_ids
from relayrl.common.pb import episode_pb2, inference_pb2, reward_pb2
from relayrl.common.tool_calls import tool_turn_text
from relayrl.config.rollout import RolloutConfig, ToolFormat
from relayrl.rollout.workflows.api import WorkflowContext
from relayrl.rollout.workflows.multi_turn import MultiTurnWorkflow
from relayrl.rollout.workflows.tools import ToolEnvironment, ToolSet
from tests.chat_model import IM_END, build_chat_tokenizer

# the tool-message part of Qwen2.5's template: consecutive tool messages share one user turn
QWEN_TOOLS_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
WANT = "<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = build_chat_tokenizer()
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    return tok


class TokenizingModel:
    """Inference's Generate with a real tokenizer: a conversation is rendered by its chat template, later turns
    append ``suffix_text`` tokenised without special tokens added (as the native engine does), and each turn
    samples a scripted text."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.tok, self.turns, self.prompts = tokenizer, turns, []  # type: ignore[var-annotated]

    async def generate(
        self,
        prompt: Any,
        sampling: inference_pb2.SamplingParams,
        timeout_s: float = 120.0,
        request_id: str = "",
        suffix_text: str = "",
    ) -> inference_pb2.GenerateResponse:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            ids = chat_token_ids(self.tok, prompt)  # what inference does with a conversation
        elif isinstance(prompt, str):
            ids = self.tok.encode(prompt, add_special_tokens=False)  # ... and with text: tokenized as is
        else:
            ids = list(prompt)
        ids += self.tok.encode(suffix_text, add_special_tokens=False) if suffix_text else []
        self.prompts.append(ids)
        text = self.turns[int(request_id.rsplit("-", 1)[1])]
        out = self.tok.encode(text, add_special_tokens=False)
        return inference_pb2.GenerateResponse(
            prompt_token_ids=ids,
            samples=[
                inference_pb2.Sample(
                    token_ids=out,
                    logprobs=[-0.25] * len(out),
                    weight_versions=[3] * len(out),
                    text=text,
                    finish_reason=1,
                )
            ],
        )


class Ok:
    async def score_batch(self, requests: Any, timeout_s: float = 60.0) -> reward_pb2.ScoreBatchResponse:
        return reward_pb2.ScoreBatchResponse(
            responses=[
                reward_pb2.ScoreResponse(episode_id=r.episode_id, score=1.0, status=reward_pb2.SCORE_STATUS_OK)
                for r in requests
            ]
        )


def test_tool_turn_text_is_what_the_template_writes_between_two_assistant_turns(tokenizer: Any) -> None:
    one = tool_turn_text(tokenizer.apply_chat_template, ["3"])
    two = tool_turn_text(tokenizer.apply_chat_template, ["3", "x"])

    assert one == WANT
    assert two == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\nx\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_without_tool_messages_falls_back_to_plain_tool_response_blocks(tokenizer: Any) -> None:
    def refuses(*args: Any, **kwargs: Any) -> str:
        raise ValueError("this template has no tool role")

    assert tool_turn_text(refuses, ["3"]) is None
    tools = ToolSet.from_specs(["tests.unit.rollout.test_tool_turns:add"], ToolFormat.HERMES, 5.0, tokenizer=tokenizer)
    assert tools.render(["3"], chat=False) == "<tool_response>\n3\n</tool_response>\n"  # a text prompt: no turns


async def test_chat_episode_appends_the_templated_tool_turn_as_masked_token_ids(tokenizer: Any) -> None:
    cfg = RolloutConfig(
        workflow="tools",
        tools=["tests.unit.rollout.test_tool_turns:add"],
        tool_format=ToolFormat.HERMES,
        max_new_tokens=64,
        max_episode_tokens=256,
        max_turns=3,
        group_size=1,
    )
    tools = ToolSet.from_specs(cfg.tools, cfg.tool_format, cfg.tool_timeout_s, tokenizer=tokenizer)
    workflow = MultiTurnWorkflow(
        lambda row: ToolEnvironment(tools, cfg.max_tool_calls), score=True, stop=tools.stops(), answer=tools.answer
    )
    model = TokenizingModel(tokenizer, [CALL, "It is 3." + IM_END])
    row = Prompt("r", "What is 1+2?", "3", messages=(("user", "What is 1+2?"),))
    ctx = WorkflowContext(
        inference=model, reward=Ok(), group_id="g", group_size=1, producer_id="t", created_at=time.time(), config=cfg
    )

    (ep,) = await workflow(row, ctx)  # type: ignore[arg-type]

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    call, obs, answer = enc(CALL), enc(WANT), enc("It is 3." + IM_END)
    assert tokenizer.decode(obs) == WANT
    assert obs.count(tokenizer.convert_tokens_to_ids(IM_END)) == 2  # the markers are special tokens, not text
    assert list(ep.completion_token_ids) == call + obs + answer
    assert list(ep.loss_mask) == [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    assert list(ep.behaviour_logprobs) == [-0.25] * len(call) + [0.0] * len(obs) + [-0.25] * len(answer)
    assert list(ep.token_weight_versions) == [3] * len(ep.completion_token_ids)
    # the second turn's prompt is the first turn's exact ids plus the observation's: nothing re-rendered
    assert model.prompts[1] == list(ep.prompt_token_ids) + call + obs
    assert (ep.tool_calls, ep.tool_errors, ep.episode_end) == (1, 0, episode_pb2.EpisodeEnd.EPISODE_END_DONE)


# a Qwen2.5-style system block listing the tools (a template that reads `tools`), then the turns above
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}" + QWEN_TOOLS_TEMPLATE
)
QUESTION = Prompt("r", "What is 1+2?", "3", messages=(("user", "What is 1+2?"),))


async def _first_prompt_ids(tokenizer: Any, fmt: ToolFormat, row: Prompt) -> list[int]:
    """The prompt ids of the first turn of a tools episode (one scripted answer, no call)."""
    cfg = RolloutConfig(
        workflow="tools",
        tools=["tests.unit.rollout.test_tool_turns:add"],
        tool_format=fmt,
        max_new_tokens=64,
        max_episode_tokens=256,
        max_turns=3,
        group_size=1,
    )
    tools = ToolSet.from_specs(cfg.tools, cfg.tool_format, cfg.tool_timeout_s, tokenizer=tokenizer)
    workflow = MultiTurnWorkflow(
        lambda row: ToolEnvironment(tools, cfg.max_tool_calls), score=True, stop=tools.stops(), answer=tools.answer
    )
    model = TokenizingModel(tokenizer, ["It is 3." + IM_END])
    ctx = WorkflowContext(
        inference=model, reward=Ok(), group_id="g", group_size=1, producer_id="t", created_at=time.time(), config=cfg
    )
    (ep,) = await workflow(row, ctx)  # type: ignore[arg-type]
    assert list(ep.prompt_token_ids) == model.prompts[0]
    return model.prompts[0]


async def test_chat_prompt_shows_the_tools_schemas_once_when_the_template_renders_tools() -> None:
    tok = build_chat_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    schema = json.dumps(
        ToolSet.from_specs(["tests.unit.rollout.test_tool_turns:add"], ToolFormat.HERMES, 5.0).tools["add"].schema
    )

    ids = await _first_prompt_ids(tok, ToolFormat.HERMES, QUESTION)

    text = tok.decode(ids)
    assert text.count(schema) == 1 and '"name": "add"' in schema
    # exactly the ids of the template's own rendering with tools=: its markers are special tokens, not text
    tools = [{"type": "function", "function": json.loads(schema)}]
    want = tok.apply_chat_template(list(QUESTION.chat()), tools=tools, add_generation_prompt=True, tokenize=True)
    assert ids == [int(i) for i in (want["input_ids"] if hasattr(want, "keys") else want)]
    assert ids.count(tok.convert_tokens_to_ids(IM_END)) == 2  # the tools' system turn and the user's


@pytest.mark.parametrize("case", ["text prompt", "template without tools", "tagged format"])
async def test_prompt_without_a_tool_rendering_is_unchanged(case: str) -> None:
    tok = build_chat_tokenizer()
    tok.chat_template = QWEN_TOOLS_TEMPLATE if case == "template without tools" else TOOLS_TEMPLATE
    fmt = ToolFormat.TAGGED if case == "tagged format" else ToolFormat.HERMES
    row = Prompt("r", "What is 1+2?", "3") if case == "text prompt" else QUESTION

    ids = await _first_prompt_ids(tok, fmt, row)

    want = (
        tok.encode(row.prompt, add_special_tokens=False)
        if case == "text prompt"
        else chat_token_ids(tok, list(row.chat()))
    )  # the text as written / the conversation as inference renders it, no tools
    assert ids == want
    assert "<tools>" not in tok.decode(ids)
