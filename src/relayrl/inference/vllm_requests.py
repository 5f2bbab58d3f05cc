"""The vLLM engine's requests: the ones it refuses (see :mod:`relayrl.inference.vllm_engine` on logprobs), and the
bookkeeping of the others: each request's samples as they grow from vLLM's per-step output deltas (every new token
also sent to the request's ``on_token``), the vLLM requests serving them, and the finished request's
:class:`SampleOutput` values. Nothing here imports vLLM."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH, FINISH_REASON_STOP, FINISH_REASON_STOP_STRING
from relayrl.inference.engine import Alternatives, GenerationInput, SampleOutput, TokenEvent
from relayrl.inference.vllm_convert import alternatives, greedy


@dataclass
class Partial:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = FINISH_REASON_LENGTH
    tops: list[Alternatives] = field(default_factory=list)
    finished: bool = False


@dataclass
class Request:
    inp: GenerationInput
    future: Future[list[SampleOutput]]
    id: str
    samples: list[Partial]
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top: list[Alternatives] = field(default_factory=list)


@dataclass
class Seq:
    """One vLLM request: every sample of a request or, after an adapter swap under ``recompute``, the rest of one."""

    req: Request
    indices: list[int]  # vLLM's sample index -> the request's sample index
    version: int  # the weight version serving it (with LoRA: its adapter's, fixed from admission to its end)


def check_input(inp: GenerationInput, context: int) -> None:
    """ValueError for a request the vllm engine does not serve: one whose logprobs vLLM would take against
    relayrl's convention, or one longer than the model's ``context`` length."""
    if inp.top_p < 1.0 or (inp.top_k > 0 and not greedy(inp)):
        raise ValueError(
            "the vllm engine does not sample with top_p/top_k truncation: its logprobs would be "
            "taken after truncation, against relayrl's convention (use the native engine)"
        )
    if greedy(inp) and inp.n > 1:
        raise ValueError(
            f"the vllm engine decodes greedily one sample at a time (n=1, got n={inp.n}): vLLM "
            "refuses n > 1 at temperature 0"
        )
    if inp.prompt_logprobs is not None and inp.temperature != 1.0:
        raise ValueError(
            "the vllm engine scores prompts (prompt logprobs, echo) at temperature 1 only: vLLM "
            f"does not temper them, and this request samples at {inp.temperature}"
        )
    if len(inp.prompt_ids) + inp.max_new_tokens > context:
        raise ValueError(
            f"prompt ({len(inp.prompt_ids)} tokens) + max_new_tokens ({inp.max_new_tokens}) "
            f"exceeds the model's context length {context}"
        )


def add_output(seq: Seq, o: Any, version: int) -> None:
    """Append one step's delta of a vLLM sample (``o``, a CompletionOutput of ``seq``) to the request's sample,
    its tokens stamped with ``version``."""
    req = seq.req
    index = seq.indices[o.index]
    part = req.samples[index]
    new = list(o.token_ids)
    entries = list(o.logprobs or [])
    lps = [float(d[t].logprob) for d, t in zip(entries, new, strict=True)]
    tops = [alternatives(d, req.inp.top_logprobs) for d in entries]
    part.token_ids += new
    part.logprobs += lps
    part.tops += tops
    part.versions += [version] * len(new)
    part.text += o.text
    if req.inp.on_token is not None and not req.future.cancelled():
        for t, lp, top in zip(new, lps, tops, strict=True):
            req.inp.on_token(TokenEvent(index, t, lp, version, top))
    if o.finish_reason == "stop":
        part.finish_reason = FINISH_REASON_STOP_STRING if isinstance(o.stop_reason, str) else FINISH_REASON_STOP
    elif o.finish_reason == "length":
        part.finish_reason = FINISH_REASON_LENGTH
    part.finished = part.finished or o.finish_reason is not None


def sample_outputs(req: Request) -> list[SampleOutput]:
    """The request's samples, all finished, as the engine returns them."""
    return [
        SampleOutput(
            p.token_ids,
            p.logprobs,
            p.versions,
            p.finish_reason,
            p.text,
            p.tops if req.inp.top_logprobs else [],
            list(req.prompt_logprobs),
            list(req.prompt_top),
        )
        for p in req.samples
    ]
