"""Generation engines behind one narrow interface, and the native PyTorch engine.

The native engine decodes a batch of sequences with a KV cache. Every decode step runs under the weight
lock and stamps the tokens it produces with the weight version it read under that lock, so a weight swap
(which takes the same lock) lands between two decode steps and tokens after it carry the new version.

Logprob convention: the logprob of a sampled token is taken from the full softmax of logits / temperature,
*before* top-k/top-p truncation. The trainer recomputes logprobs the same way (log_softmax at the
episode's temperature), so importance ratios compare like with like.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from relayrl.common.pb.common_pb2 import FINISH_REASON_LENGTH, FINISH_REASON_STOP, FINISH_REASON_STOP_STRING
from relayrl.common.weights import StaleVersionError, TensorSpec, WeightUpdateError, parameter_specs
from relayrl.inference.config import KvOnUpdate

log = logging.getLogger(__name__)


@dataclass
class GenerationInput:
    prompt_ids: list[int]
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: int
    text: str


class Engine(Protocol):
    """What the inference service needs from an engine."""

    @property
    def version(self) -> int: ...

    def generate(self, batch: Sequence[GenerationInput]) -> list[list[SampleOutput]]:
        """Generate ``n`` samples for each input (blocking; call from a worker thread)."""
        ...

    def update_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap in new weights atomically between decode steps (blocking)."""
        ...


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (token ids [B], their logprobs [B] under the full tempered softmax).

    logits [B, V] (any float dtype), temperature [B] (> 0), top_k [B] (0 = off), top_p [B] (1 = off).
    """
    assert logits.dim() == 2 and temperature.shape == logits.shape[:1], (logits.shape, temperature.shape)
    scaled = logits.float() / temperature.unsqueeze(1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    vocab = scaled.shape[1]
    truncate = bool(((top_k > 0) & (top_k < vocab)).any() | (top_p < 1.0).any())
    if truncate:
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
        probs_sorted = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        keep = (ranks < k) & (mass_before < top_p.unsqueeze(1))
        keep[:, 0] = True  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
        choice = torch.multinomial(torch.softmax(sorted_logits, dim=-1), 1, generator=generator)
        tokens = sorted_idx.gather(1, choice).squeeze(1)
    else:
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


class NativeEngine:
    """Batched sampling with a Hugging Face causal LM and its KV cache."""

    def __init__(self, model: Any, tokenizer: Any, device: torch.device, version: int = 0,
                 kv_on_update: KvOnUpdate = KvOnUpdate.RECOMPUTE) -> None:
        self.model = model
        self.kv_on_update = kv_on_update
        self.decode_steps = 0  # forward passes run so far (for status and tests)
        self.tokenizer = tokenizer
        self.device = device
        self._version = version
        self._lock = threading.Lock()
        self._specs = parameter_specs(model)
        self._params = dict(model.named_parameters())
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id)
        # transformers renamed past_key_values to cache (5.2x); support both spellings
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in params

    @property
    def version(self) -> int:
        return self._version

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def update_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        if set(tensors) != set(self._specs):
            raise WeightUpdateError("update names do not match the model's parameters")
        staged = {}
        for name, t in tensors.items():
            spec = self._specs[name]
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                raise WeightUpdateError(f"{name}: {t.dtype}{list(t.shape)} != {spec.dtype}{list(spec.shape)}")
            staged[name] = t.to(self.device, non_blocking=True)
        with self._lock, torch.no_grad():
            if version <= self._version:
                raise StaleVersionError(f"version {version} is not newer than the served version {self._version}")
            for name, t in staged.items():
                self._params[name].copy_(t)
            self._version = version
        log.info("weights swapped to version %d", version)

    @torch.inference_mode()
    def generate(self, batch: Sequence[GenerationInput]) -> list[list[SampleOutput]]:
        if not batch:
            return []
        seeds = {inp.seed for inp in batch}
        generator: torch.Generator | None = None
        if len(batch) == 1 and batch[0].seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(batch[0].seed))
        elif seeds != {None}:
            raise ValueError("seeded requests must be generated alone")
        rows = [inp for inp in batch for _ in range(inp.n)]
        out = self._decode(rows, generator)
        results: list[list[SampleOutput]] = []
        i = 0
        for inp in batch:
            results.append(out[i : i + inp.n])
            i += inp.n
        return results

    def _decode(self, rows: list[GenerationInput], generator: torch.Generator | None) -> list[SampleOutput]:
        dev = self.device
        bsz = len(rows)
        prompt_len = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((bsz, prompt_len), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((bsz, prompt_len), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding
            input_ids[i, prompt_len - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            attn[i, prompt_len - len(r.prompt_ids):] = 1
        input_ids, attn = input_ids.to(dev), attn.to(dev)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)

        temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=dev)
        top_k = torch.tensor([r.top_k for r in rows], dtype=torch.long, device=dev)
        top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=dev)
        max_new = torch.tensor([r.max_new_tokens for r in rows], dtype=torch.long, device=dev)
        stop_width = max(1, max(len(r.stop_token_ids) for r in rows) + 1)
        stop_ids = torch.full((bsz, stop_width), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            ids = [*([] if r.ignore_eos else [self.eos_token_id]), *r.stop_token_ids]
            stop_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        stop_ids = stop_ids.to(dev)
        string_rows = [i for i, r in enumerate(rows) if r.stop]

        steps = int(max_new.max())
        tokens = torch.full((bsz, steps), self.pad_token_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros((bsz, steps), dtype=torch.float32, device=dev)
        versions = torch.zeros((bsz, steps), dtype=torch.long, device=dev)
        lengths = torch.zeros(bsz, dtype=torch.long, device=dev)
        finished = torch.zeros(bsz, dtype=torch.bool, device=dev)
        reason = torch.full((bsz,), FINISH_REASON_LENGTH, dtype=torch.long, device=dev)

        past: Any = None
        cache_version = -1
        step_ids, step_pos = input_ids, position_ids
        for t in range(steps):
            with self._lock:  # weights cannot change during a decode step
                version = self._version
                if past is not None and version != cache_version and self.kv_on_update is KvOnUpdate.RECOMPUTE:
                    # weights changed since the cache was built: rebuild it from the whole sequence so far
                    step_ids = torch.cat([input_ids, tokens[:, :t]], dim=1)
                    step_pos = (attn.cumsum(-1) - 1).clamp(min=0)
                    past = None
                out = self.model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                                 use_cache=True, **self._forward_kwargs(past))
                cache_version = version if past is None else cache_version
                self.decode_steps += 1
            past = getattr(out, self._cache_arg)
            tok, lp = sample_tokens(out.logits[:, -1, :], temperature, top_k, top_p, generator)
            active = ~finished
            tokens[:, t] = torch.where(active, tok, torch.full_like(tok, self.pad_token_id))
            logprobs[:, t] = torch.where(active, lp, torch.zeros_like(lp))
            versions[:, t] = version
            lengths += active.long()
            hit_stop = active & (tok.unsqueeze(1) == stop_ids).any(dim=1)
            reason = torch.where(hit_stop, torch.full_like(reason, FINISH_REASON_STOP), reason)
            finished |= hit_stop | (lengths >= max_new)
            if string_rows:
                finished, reason = self._check_stop_strings(rows, string_rows, tokens, lengths, finished, reason)
            if bool(finished.all()):
                break
            step_ids = tok.unsqueeze(1)
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((bsz, 1), dtype=attn.dtype, device=dev)], dim=1)

        tok_list = tokens.cpu().tolist()
        lp_list = logprobs.cpu().tolist()
        ver_list = versions.cpu().tolist()
        len_list = lengths.cpu().tolist()
        reason_list = reason.cpu().tolist()
        samples = []
        for i, r in enumerate(rows):
            n = len_list[i]
            ids = tok_list[i][:n]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if reason_list[i] == FINISH_REASON_STOP_STRING:
                text = _cut_at_stop(text, r.stop)
            samples.append(SampleOutput(ids, lp_list[i][:n], ver_list[i][:n], int(reason_list[i]), text))
        return samples

    def _forward_kwargs(self, past: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {self._cache_arg: past}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1  # only the last position's logits are sampled from
        return kwargs

    def _check_stop_strings(
        self, rows: list[GenerationInput], string_rows: list[int], tokens: torch.Tensor,
        lengths: torch.Tensor, finished: torch.Tensor, reason: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fin = finished.cpu()
        lens = lengths.cpu().tolist()
        hits = []
        for i in string_rows:
            if fin[i]:
                continue
            text = self.tokenizer.decode(tokens[i, : lens[i]].tolist(), skip_special_tokens=True)
            if any(s in text for s in rows[i].stop):
                hits.append(i)
        if hits:
            idx = torch.tensor(hits, dtype=torch.long, device=finished.device)
            finished = finished.index_fill(0, idx, True)
            reason = reason.index_fill(0, idx, FINISH_REASON_STOP_STRING)
        return finished, reason


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text
