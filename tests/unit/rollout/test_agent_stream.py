"""The session endpoint's streamed events (agent_stream.SseWriter): text leaves as tokens add it, a part of a UTF-8
character waits for the rest, the stop string ends the text, and the chunks add up to the recorded answer."""

from __future__ import annotations

import json
from typing import Any

from relayrl.common.openai_sse import DONE
from relayrl.common.pb import inference_pb2
from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH, FINISH_REASON_STOP_STRING
from relayrl.rollout.workflows.agent_chat import ChatRequest, answer
from relayrl.rollout.workflows.agent_stream import CompletionRequest, SseWriter, completion_answer


def _text_of(ids: list[int]) -> str:  # a byte-level tokenizer: one token per byte
    return bytes(ids).decode("utf-8", errors="replace")


def _piece(token: int) -> str:
    return _text_of([token])


def _chunks(events: list[str]) -> list[dict[str, Any]]:
    return [json.loads(e.removeprefix("data: ")) for e in events if e != DONE]


TOKENS = [*"hé!x".encode()]  # h, é (two bytes), the stop string "!", one more byte in the same step
SAMPLE = inference_pb2.Sample(
    token_ids=TOKENS,
    logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5],
    weight_versions=[3, 3, 4, 4, 4],
    finish_reason=FINISH_REASON_STOP_STRING,
    text="hé!",
)


def test_chat_chunks_leave_as_tokens_add_text_and_add_up_to_the_recorded_answer() -> None:
    req = ChatRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "stream": True}
    )
    writer = SseWriter(req, True, "m", _text_of, _piece, ["!"])

    start = _chunks(writer.start())
    per_token = [
        _chunks(writer.add([t], [lp], [v]))
        for t, lp, v in zip(SAMPLE.token_ids[:3], SAMPLE.logprobs[:3], SAMPLE.weight_versions[:3], strict=True)
    ]
    stop = _chunks(writer.add(list(SAMPLE.token_ids[3:]), list(SAMPLE.logprobs[3:]), list(SAMPLE.weight_versions[3:])))
    recorded = answer(req, SAMPLE, "m", 2, [_piece(t) for t in SAMPLE.token_ids])
    last = writer.finish(recorded, SAMPLE, usage=True)

    assert start[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [len(c) for c in per_token] == [1, 0, 1]  # é's first byte alone is no text yet
    assert per_token[2][0]["choices"][0]["delta"]["content"] == "é"
    assert per_token[2][0]["choices"][0]["weight_versions"] == [3, 4]  # both bytes of é
    assert stop[0]["choices"][0]["delta"]["content"] == "!"  # cut after the stop string, as inference cuts
    final, usage = _chunks(last)
    assert last[-1] == DONE and final["choices"][0]["finish_reason"] == "stop" and usage["usage"]["total_tokens"] == 7
    choices = [c["choices"][0] for c in (*start, *per_token[0], *per_token[2], *stop, final)]
    assert "".join(c["delta"].get("content", "") for c in choices) == recorded["choices"][0]["message"]["content"]
    assert [v for c in choices for v in c.get("weight_versions", [])] == list(SAMPLE.weight_versions)
    logprobs = [t["logprob"] for c in choices if c["logprobs"] for t in c["logprobs"]["content"]]
    assert logprobs == [t["logprob"] for t in recorded["choices"][0]["logprobs"]["content"]]


def test_completion_chunks_carry_their_text_offsets_and_the_last_the_finish_reason() -> None:
    req = CompletionRequest.model_validate({"prompt": "p", "logprobs": 0, "stream": True})
    sample = inference_pb2.Sample(
        token_ids=[104, 105],
        logprobs=[-0.1, -0.2],
        weight_versions=[3, 3],
        text="hi",
        finish_reason=FINISH_REASON_LENGTH,
    )
    writer = SseWriter(req, False, "m", _text_of, _piece, [])

    events = [*writer.start(), *writer.add([104], [-0.1], [3]), *writer.add([105], [-0.2], [3])]
    final = writer.finish(completion_answer(req, sample, "m", 1, ["h", "i"]), sample, usage=False)

    chunks = _chunks([*events, *final])
    assert [c["choices"][0]["text"] for c in chunks] == ["h", "i", ""]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[:2]] == [[0], [1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and final[-1] == DONE
