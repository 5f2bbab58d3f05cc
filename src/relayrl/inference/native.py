"""The native PyTorch engine: continuous batching over a Hugging Face causal LM with an engine-managed KV cache.

One engine thread runs the loop. Each iteration, between two decode steps: apply a pending weight swap (and
score the probe batch under the new weights), drop cancelled requests, rebuild the KV cache of running rows if
the weights changed (``kv_on_update: recompute``), admit queued requests that fit (their prompts are prefilled
together, once per prompt: the n samples of a prompt share its prefill and start from copies of its cache),
then one decode step for every running row. Rows whose sample finished leave the batch at once; the request's
future resolves when its last sample finishes. Every token is stamped with the weight version of the step that
produced it. A seeded request runs alone with its own generator, so it is reproducible. Logprob alternatives
(``top_logprobs``) come from the same tempered softmax in the same sampling step, into a [rows, steps, k] tensor
(k: the batch's largest ask); prompt logprobs need the prefill's logits at every position, which are kept only
when an admitted request asks for them. A request with ``on_token`` gets each of its tokens as it is sampled.
"""

from __future__ import annotations

import collections
import inspect
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from relayrl.common.logging import log_context
from relayrl.common.model import end_token_ids
from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH, FINISH_REASON_STOP, FINISH_REASON_STOP_STRING
from relayrl.common.probe import probe_logprobs, timed_probe_logprobs
from relayrl.common.weights import StaleVersionError, TensorSpec, check_tensors, parameter_specs
from relayrl.config.inference import KvOnUpdate
from relayrl.inference.batch import KV, BatchState, RowParams
from relayrl.inference.engine import EngineStats, GenerationInput, SampleOutput, sample_with_alternatives
from relayrl.inference.native_rows import Request as _Request
from relayrl.inference.native_rows import Row as _Row
from relayrl.inference.native_rows import fail as _fail
from relayrl.inference.native_rows import finished_samples, prompt_logprobs, resolve, stop_string_hits, stream_step
from relayrl.inference.native_weights import Swap as _Swap
from relayrl.inference.native_weights import module_paths, served_mismatch

log = logging.getLogger(__name__)


class NativeEngine:
    """Continuous-batching generation with a Hugging Face causal LM (CPU or CUDA)."""

    computes_alternatives = True  # top_logprobs / prompt_logprobs of GenerationInput are honoured

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: torch.device,
        version: int = 0,
        kv_on_update: KvOnUpdate = KvOnUpdate.RECOMPUTE,
        max_batch_sequences: int = 256,
        max_prefill_tokens: int = 8192,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.kv_on_update = kv_on_update
        self.max_rows = max_batch_sequences
        self.max_prefill_tokens = max_prefill_tokens
        self.decode_steps, self.last_probe_s = 0, 0.0  # forward passes so far; seconds of the last probe
        self.cancelled_sequences = 0  # rows dropped because their request was cancelled
        self._version = version
        self._specs = parameter_specs(model)
        self._params = dict(model.named_parameters())
        self._paths = module_paths(model, self._params)  # (module, attribute, path) of every path of each parameter
        self.last_served_mismatch = ""  # of the last swap: a module path that does not read the update ("": none)
        self.eos_token_id = int(tokenizer.eos_token_id)
        # EOS and the end-of-turn tokens of the model's generation config: each ends a sample
        self.eos_token_ids = end_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id)
        # transformers renamed past_key_values to cache (5.2x); support both spellings
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft (LoRA) wrapper
        params = inspect.signature(base.forward).parameters  # the wrapper passes these keywords through
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in params
        self._cond = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._swaps: list[_Swap] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self._batch: BatchState | None = None
        self._rows: list[_Row] = []
        self._exclusive = False  # a seeded request is running: admit nothing else

    # -- the Engine interface ------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    def stats(self) -> EngineStats:
        with self._cond:
            requests = len({id(r.req) for r in self._rows})
            return EngineStats(len(self._rows), requests, len(self._queue), self.decode_steps, self.cancelled_sequences)

    def submit(self, inp: GenerationInput) -> Future[list[SampleOutput]]:
        if inp.n > self.max_rows:
            raise ValueError(f"n={inp.n} exceeds the engine's max_batch_sequences={self.max_rows}")
        if len(inp.prompt_ids) + inp.max_new_tokens > self.context_length:
            raise ValueError(
                f"prompt ({len(inp.prompt_ids)} tokens) + max_new_tokens ({inp.max_new_tokens}) "
                f"exceeds the model's context length {self.context_length}"
            )
        req = _Request(inp, Future(), [None] * inp.n, inp.n)
        if inp.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(int(inp.seed))
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._queue.append(req)
            self._ensure_thread()
            self._cond.notify()
        return req.future

    def update_weights(
        self, tensors: Mapping[str, torch.Tensor], version: int, probe: Sequence[Sequence[int]] = ()
    ) -> list[float]:
        check_tensors(tensors, self._specs)
        staged = {name: t.to(self.device) for name, t in tensors.items()}
        swap = _Swap(staged, version, probe)
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._swaps.append(swap)
            self._ensure_thread()
            self._cond.notify()
        return swap.done.result()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for req in list(self._queue) + [r.req for r in self._rows]:
            _fail(req, RuntimeError("engine closed"))

    # -- the engine thread ---------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._queue or self._swaps or self._rows or self._closed):
                    self._cond.wait()
                if self._closed:
                    return
                swaps, self._swaps = self._swaps, []
                admitted = self._admit()
            for swap in swaps:
                self._apply_swap(swap)
            try:
                with torch.inference_mode():
                    self._iteration(admitted)
            except Exception as exc:  # a failed step fails the requests in it; the engine keeps serving
                log.exception("engine step failed; failing %d running requests", len({id(r.req) for r in self._rows}))
                for req in {id(r.req): r.req for r in self._rows}.values():
                    _fail(req, exc)
                for req in admitted:
                    _fail(req, exc)
                with self._cond:
                    self._rows, self._batch, self._exclusive = [], None, False

    def _admit(self) -> list[_Request]:
        """Queued requests that fit now, FIFO (called with the condition held)."""
        admitted: list[_Request] = []
        rows = len(self._rows)
        prefill = width = 0
        while self._queue and not self._exclusive:
            req = self._queue[0]
            if req.future.cancelled():
                self._queue.popleft()
                continue
            if req.inp.seed is not None and (rows or admitted):
                break  # a seeded request waits until it can run alone
            scoring = req.inp.prompt_logprobs is not None
            if admitted and scoring != (admitted[-1].inp.prompt_logprobs is not None):
                break  # prompt-scoring requests prefill only together: every row of theirs computes [width, vocab]
            tokens = len(req.inp.prompt_ids)
            if rows + req.inp.n > self.max_rows or (
                admitted
                and max(prefill + tokens, scoring * (len(admitted) + 1) * max(width, tokens)) > self.max_prefill_tokens
            ):
                break  # (scoring rows' logits hold rows x the longest prompt, padding included: bounded as well)
            admitted.append(self._queue.popleft())
            rows, prefill, width = rows + req.inp.n, prefill + tokens, max(width, tokens)
            if req.inp.seed is not None:
                self._exclusive = True
                break
        return admitted

    def _apply_swap(self, swap: _Swap) -> None:
        """Swap the staged tensors in by reference, score the probe; on failure restore the old ones (version kept)."""
        try:
            if swap.version <= self._version:
                raise StaleVersionError(f"version {swap.version} is not newer than the served version {self._version}")
            old = {name: p.data for name, p in self._params.items()}
            try:
                for name, t in swap.tensors.items():
                    self._params[name].data = t
                self.last_served_mismatch = served_mismatch(self._paths, swap.tensors)
                result, self.last_probe_s = timed_probe_logprobs(probe_logprobs, self.model, swap.probe, self.device)
            except BaseException:
                for name, t in old.items():
                    self._params[name].data = t
                raise
            self._version = swap.version
            with log_context(weight_version=swap.version):
                log.info("weights swapped to version %d", swap.version)
            swap.done.set_result(result)
        except Exception as exc:
            swap.done.set_exception(exc)

    def _iteration(self, admitted: list[_Request]) -> None:
        self._drop_cancelled()
        batch = self._batch
        if batch is not None and batch.cache_version != self._version and self.kv_on_update is KvOnUpdate.RECOMPUTE:
            self._recompute(batch)
        if admitted:
            new_batch, new_rows = self._prefill(admitted)
            self._batch = new_batch if self._batch is None else BatchState.concat(self._batch, new_batch)
            with self._cond:
                self._rows = self._rows + new_rows
            self._retire()
        if self._batch is not None:
            self._decode_step(self._batch)
            self._retire()

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, kv: KV | None, all_logits: bool = False
    ) -> tuple[Any, KV]:
        """Logits of the last position [B, V] (of every position [B, L, V] with ``all_logits``) and the cache."""
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=kv) if kv else DynamicCache()
        kwargs: dict[str, Any] = {self._cache_arg: cache}
        if self._logits_to_keep and not all_logits:
            kwargs["logits_to_keep"] = 1  # only the last position's logits are sampled from
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kwargs)
        cache = getattr(out, self._cache_arg)
        self.decode_steps += 1
        logits = out.logits if all_logits else out.logits[:, -1, :]
        return logits, [(layer.keys, layer.values) for layer in cache.layers]

    def _prefill(self, reqs: list[_Request]) -> tuple[BatchState, list[_Row]]:
        dev = self.device
        width = max(len(r.inp.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding, one row per prompt
            ids[i, width - len(r.inp.prompt_ids) :] = torch.tensor(r.inp.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.inp.prompt_ids) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        want_prompt = any(r.inp.prompt_logprobs is not None for r in reqs)
        logits, kv = self._forward(ids, mask, pos, None, all_logits=want_prompt)
        if want_prompt:  # the prompt's own logprobs need every position's logits (only computed when asked)
            prompt_logprobs(reqs, logits, ids, mask)
            logits = logits[:, -1, :]
        # the n samples of a prompt share its prefill: expand rows after the forward pass
        counts = torch.tensor([r.inp.n for r in reqs], dtype=torch.long, device=dev)
        expand = torch.repeat_interleave(torch.arange(len(reqs), device=dev), counts)
        rows = [_Row(r, j) for r in reqs for j in range(r.inp.n)]
        inputs = [r.req.inp for r in rows]
        stop_lists = [[*([] if inp.ignore_eos else self.eos_token_ids), *inp.stop_token_ids] for inp in inputs]
        stop_ids = torch.full((len(rows), max(1, *map(len, stop_lists))), -1, dtype=torch.long)
        for i, s in enumerate(stop_lists):
            stop_ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        params = RowParams(
            temperature=torch.tensor([x.temperature for x in inputs], dtype=torch.float32, device=dev),
            top_k=torch.tensor([x.top_k for x in inputs], dtype=torch.long, device=dev),
            top_p=torch.tensor([x.top_p for x in inputs], dtype=torch.float32, device=dev),
            max_new=torch.tensor([x.max_new_tokens for x in inputs], dtype=torch.long, device=dev),
            stop_ids=stop_ids.to(dev),
        )
        steps = max(x.max_new_tokens for x in inputs)
        alternatives = min(max(x.top_logprobs for x in inputs), logits.shape[-1])  # no more than the vocabulary
        batch = BatchState(
            kv=[(k.index_select(0, expand), v.index_select(0, expand)) for k, v in kv],
            mask=mask.index_select(0, expand),
            ids=ids.index_select(0, expand),
            next_tok=torch.zeros(len(rows), dtype=torch.long, device=dev),
            pos=mask.sum(dim=1).index_select(0, expand),
            params=params,
            out_tok=torch.full((len(rows), steps), self.pad_token_id, dtype=torch.long, device=dev),
            out_lp=torch.zeros((len(rows), steps), dtype=torch.float32, device=dev),
            out_ver=torch.zeros((len(rows), steps), dtype=torch.long, device=dev),
            length=torch.zeros(len(rows), dtype=torch.long, device=dev),
            cache_version=self._version,
            out_top_lp=torch.full((len(rows), steps, alternatives), float("-inf"), device=dev),
            out_top_id=torch.full((len(rows), steps, alternatives), -1, dtype=torch.long, device=dev),
        )
        self._sample(batch, logits.index_select(0, expand), rows)
        return batch, rows

    def _decode_step(self, batch: BatchState) -> None:
        ones = torch.ones((batch.rows, 1), dtype=batch.mask.dtype, device=batch.mask.device)
        mask = torch.cat([batch.mask, ones], dim=1)
        logits, batch.kv = self._forward(batch.next_tok.unsqueeze(1), mask, batch.pos.unsqueeze(1), batch.kv)
        batch.mask = mask
        batch.ids = torch.cat([batch.ids, batch.next_tok.unsqueeze(1)], dim=1)
        batch.pos = batch.pos + 1
        self._sample(batch, logits, self._rows)

    def _recompute(self, batch: BatchState) -> None:
        """Rebuild every running row's keys/values under the current weights (exact after a swap)."""
        pos = (batch.mask.cumsum(-1) - 1).clamp(min=0)
        _, batch.kv = self._forward(batch.ids, batch.mask, pos, None)
        batch.cache_version = self._version

    def _sample(self, batch: BatchState, logits: torch.Tensor, rows: list[_Row]) -> None:
        p = batch.params
        generator = rows[0].req.generator if self._exclusive else None
        tok, lp, top = sample_with_alternatives(logits, p.temperature, p.top_k, p.top_p, generator, batch.alternatives)
        batch.record(tok, lp, self._version, top)
        batch.check()
        stream_step(rows, tok, lp, top, self._version)

    def _retire(self) -> None:
        """Move finished rows out of the batch and resolve requests whose samples are all done."""
        batch = self._batch
        assert batch is not None
        hit_stop = batch.hit_stop()
        finished = hit_stop | (batch.length >= batch.params.max_new)
        reason = torch.where(hit_stop, FINISH_REASON_STOP, FINISH_REASON_LENGTH)
        string_hits = stop_string_hits(batch, self._rows, finished, self.tokenizer)
        if string_hits:
            idx = torch.tensor(string_hits, dtype=torch.long, device=finished.device)
            finished = finished.index_fill(0, idx, True)
            reason = reason.index_fill(0, idx, FINISH_REASON_STOP_STRING)
        done = finished.nonzero().squeeze(1)
        if done.numel() == 0:
            return
        for i, sample in finished_samples(batch, self._rows, done, reason, self.tokenizer):
            row = self._rows[i]
            row.req.samples[row.index] = sample
            row.req.remaining -= 1
            if row.req.remaining == 0:
                resolve(row.req)
        done_set = set(done.tolist())
        self._keep_rows([i for i in range(batch.rows) if i not in done_set])

    def _keep_rows(self, keep: list[int]) -> None:
        batch = self._batch
        assert batch is not None
        with self._cond:
            if not keep:
                self._batch, self._rows, self._exclusive = None, [], False
                return
            index = torch.tensor(keep, dtype=torch.long, device=batch.mask.device)
            self._batch = batch.select(index)
            self._rows = [self._rows[i] for i in keep]

    def _drop_cancelled(self) -> None:
        if self._batch is None:
            return
        keep = [i for i, r in enumerate(self._rows) if not r.req.future.cancelled()]
        if len(keep) != len(self._rows):
            log.info("dropping %d rows of cancelled requests", len(self._rows) - len(keep))
            self.cancelled_sequences += len(self._rows) - len(keep)
            self._keep_rows(keep)
