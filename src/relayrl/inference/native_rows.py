"""The native engine's bookkeeping around its batched tensors: requests and their rows, streaming each step's tokens
to the requests that asked for it, prompt logprobs from a prefill's logits, and turning finished rows into
:class:`SampleOutput` values. The tensor work is batched over all rows; only the per-request results are lists."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from relayrl.inference.batch import BatchState
from relayrl.inference.engine import Alternatives, GenerationInput, SampleOutput, TokenEvent, top_alternatives


@dataclass
class Request:
    inp: GenerationInput
    future: Future[list[SampleOutput]]
    samples: list[SampleOutput | None]
    remaining: int
    generator: torch.Generator | None = None
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top: list[Alternatives] = field(default_factory=list)


@dataclass
class Row:
    req: Request
    index: int  # sample index within the request


def resolve(req: Request) -> None:
    if not req.future.cancelled():
        samples = [s for s in req.samples if s is not None]
        req.future.set_result(samples)


def fail(req: Request, exc: BaseException) -> None:
    if not req.future.done():
        req.future.set_exception(exc)


def pairs(ids: list[int], lps: list[float]) -> Alternatives:
    return [(int(i), float(lp)) for i, lp in zip(ids, lps, strict=True) if i >= 0]


def stream_step(
    rows: list[Row], tok: torch.Tensor, lp: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor], version: int
) -> None:
    """Hand this step's token of every streaming row to its request's ``on_token`` (one transfer for all rows)."""
    streaming = [i for i, r in enumerate(rows) if r.req.inp.on_token is not None]
    if not streaming:
        return
    idx = torch.tensor(streaming, dtype=torch.long, device=tok.device)
    toks, lps = tok.index_select(0, idx).tolist(), lp.index_select(0, idx).tolist()
    top_lp, top_id = top[0].index_select(0, idx).tolist(), top[1].index_select(0, idx).tolist()
    for k, i in enumerate(streaming):
        row = rows[i]
        if row.req.future.cancelled():
            continue
        want = row.req.inp.top_logprobs
        callback = row.req.inp.on_token
        assert callback is not None
        callback(TokenEvent(row.index, int(toks[k]), float(lps[k]), version, pairs(top_id[k][:want], top_lp[k][:want])))


def prompt_logprobs(reqs: list[Request], logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Store on each request that asked for them its prompt tokens' logprobs (and alternatives) from the prefill's
    logits [R, W, V] (left-padded rows): the tempered full softmax at each position, scoring the next token. The
    first prompt token has no logprob (None), as in OpenAI's API."""
    asking = [i for i, r in enumerate(reqs) if r.inp.prompt_logprobs is not None]
    if not asking:
        return
    idx = torch.tensor(asking, dtype=torch.long, device=logits.device)
    temp = torch.tensor([reqs[i].inp.temperature for i in asking], dtype=torch.float32, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, idx)[:, :-1].float() / temp.view(-1, 1, 1), dim=-1)
    nxt = ids.index_select(0, idx)[:, 1:]
    scored = logprobs.gather(2, nxt.unsqueeze(2)).squeeze(2).tolist()  # [r, W-1]
    k = max(reqs[i].inp.prompt_logprobs or 0 for i in asking)
    top_lp, top_id = (t.tolist() for t in top_alternatives(logprobs, k))
    lengths = mask.index_select(0, idx).sum(dim=1).tolist()
    for j, i in enumerate(asking):
        req, n = reqs[i], int(lengths[j])
        want = req.inp.prompt_logprobs or 0
        start = len(scored[j]) - (n - 1)  # the row's own tokens are its last n columns
        req.prompt_logprobs = [None, *scored[j][start:]]
        req.prompt_top = [[]] + [pairs(top_id[j][p][:want], top_lp[j][p][:want]) for p in range(start, len(scored[j]))]


def finished_samples(
    batch: BatchState, rows: list[Row], done: torch.Tensor, reason: torch.Tensor, tokenizer: Any
) -> list[tuple[int, SampleOutput]]:
    """(row position, output) for the finished rows ``done`` (indices into ``batch``): tokens, logprobs,
    alternatives (trimmed to each request's ask), versions, finish reason and text (cut at a stop string)."""
    from relayrl.common.pb.common_pb2 import FINISH_REASON_STOP_STRING
    from relayrl.inference.engine import cut_at_stop

    done_list = done.tolist()
    lengths = batch.length.index_select(0, done).tolist()
    toks = batch.out_tok.index_select(0, done).tolist()
    lps = batch.out_lp.index_select(0, done).tolist()
    vers = batch.out_ver.index_select(0, done).tolist()
    reasons = reason.index_select(0, done).tolist()
    top_lp = batch.out_top_lp.index_select(0, done).tolist() if batch.alternatives else None
    top_id = batch.out_top_id.index_select(0, done).tolist() if batch.alternatives else None
    out = []
    for k, i in enumerate(done_list):
        row, n = rows[i], lengths[k]
        text = tokenizer.decode(toks[k][:n], skip_special_tokens=True)
        if reasons[k] == FINISH_REASON_STOP_STRING:
            text = cut_at_stop(text, row.req.inp.stop)
        want = row.req.inp.top_logprobs
        top = (
            [pairs(top_id[k][t][:want], top_lp[k][t][:want]) for t in range(n)]
            if want and top_lp is not None and top_id is not None
            else []
        )
        out.append(
            (
                i,
                SampleOutput(
                    toks[k][:n],
                    lps[k][:n],
                    vers[k][:n],
                    int(reasons[k]),
                    text,
                    top,
                    list(row.req.prompt_logprobs),
                    list(row.req.prompt_top),
                ),
            )
        )
    return out


def stop_string_hits(batch: BatchState, rows: list[Row], finished: torch.Tensor, tokenizer: Any) -> list[int]:
    """Rows (not otherwise finished) whose text now contains one of their stop strings. Only rows of requests
    with stop strings are decoded, each up to its own length."""
    candidates = [i for i, r in enumerate(rows) if r.req.inp.stop]
    if not candidates:
        return []
    idx = torch.tensor(candidates, dtype=torch.long, device=finished.device)
    fin = finished.index_select(0, idx).tolist()
    lens = batch.length.index_select(0, idx).tolist()
    toks = batch.out_tok.index_select(0, idx).tolist()
    hits = []
    for k, i in enumerate(candidates):
        if fin[k]:
            continue
        text = tokenizer.decode(toks[k][: lens[k]], skip_special_tokens=True)
        if any(s in text for s in rows[i].req.inp.stop):
            hits.append(i)
    return hits
