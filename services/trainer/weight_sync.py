"""Publishing weights to inference: two transports behind one interface, and probe verification.

- ``grpc_stream``: the tensors' bytes in chunks on the UpdateWeights client stream (relayrl.common.weights),
  then a manifest (version, count, bytes, SHA-256, probe).
- ``shared_path``: a safetensors file written atomically under ``<output_dir>/weights`` and a manifest naming it
  (with the same checksum); inference reads the file itself. For machines that share the output root (the
  local stack, one node); no ReadWriteMany volume is assumed anywhere else. The two newest files are kept.

Either way inference validates the whole update before an atomic swap, then returns the logprobs of the probe
batch under the new weights; :class:`WeightPublisher` compares them with the logprobs of the very snapshot it
sent and raises :class:`WeightVerificationError` when they differ by more than the dtype's tolerance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from torch.func import functional_call

from relayrl.common.grpc_utils import insecure_channel
from relayrl.common.pb import inference_pb2_grpc
from relayrl.common.pb.inference_pb2 import UpdateWeightsResponse, WeightUpdateMessage
from relayrl.common.probe import compare_probe, probe_logprobs, probe_sequences
from relayrl.common.weights import iter_update_messages, manifest, write_shared
from relayrl.config.trainer import WeightTransport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushResult:
    version: int
    bytes_sent: int
    seconds: float
    probe_max_diff: float


class _Snapshot:
    """The model evaluated with a frozen copy of its parameters (a callable like the model)."""

    def __init__(self, model: Any, params: Mapping[str, torch.Tensor]) -> None:
        self.model = model
        self.params = params

    def __call__(self, **kwargs: Any) -> Any:
        return functional_call(self.model, dict(self.params), args=(), kwargs=kwargs)


class WeightPublisher:
    def __init__(self, model: Any, device: torch.device, target: str, transport: WeightTransport,
                 weights_dir: Path, chunk_bytes: int, timeout_s: float, probe: list[list[int]],
                 probe_tolerance: float | None) -> None:
        self.model = model
        self.device = device
        self.target = target
        self.transport = transport
        self.weights_dir = weights_dir
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.probe = probe
        self.probe_tolerance = probe_tolerance
        self.dtype = next(model.parameters()).dtype

    @staticmethod
    def default_probe(model: Any, tokenizer: Any, sequences: int, tokens: int, seed: int) -> list[list[int]]:
        vocab = int(model.get_input_embeddings().num_embeddings)
        special = [i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None]
        return probe_sequences(vocab, sequences, tokens, seed, exclude=special)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the parameters as they are now (the caller keeps training from changing them meanwhile)."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def expected_probe(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            return probe_logprobs(_Snapshot(self.model, params), self.probe, self.device)
        finally:
            self.model.train(was_training)

    async def push(self, params: Mapping[str, torch.Tensor], version: int) -> PushResult:
        """Send ``params`` as ``version``; verify the served weights by the probe. Raises RuntimeError when the
        push fails, WeightVerificationError when inference serves something else."""
        t0 = time.perf_counter()
        expected = await asyncio.to_thread(self.expected_probe, params)
        messages = await asyncio.to_thread(self._messages, params, version)
        resp = await self._send(messages, version)
        diff = compare_probe(expected, resp.probe_logprobs, self.dtype, version, self.probe_tolerance)
        if self.transport is WeightTransport.SHARED_PATH:
            await asyncio.to_thread(self._prune, version)
        return PushResult(version, int(resp.bytes_received), time.perf_counter() - t0, diff)

    def _messages(self, params: Mapping[str, torch.Tensor], version: int) -> list[WeightUpdateMessage]:
        if self.transport is WeightTransport.GRPC_STREAM:
            return list(iter_update_messages(params, version, self.chunk_bytes, self.probe))
        path = self.weights_dir / f"v{version:09d}.safetensors"
        write_shared(params, path)
        return [WeightUpdateMessage(manifest=manifest(params, version, self.probe, str(path.resolve())))]

    def _prune(self, version: int, keep: int = 2) -> None:
        files = sorted(self.weights_dir.glob("v*.safetensors"))
        for old in files[:-keep]:
            old.unlink(missing_ok=True)

    async def _send(self, messages: list[WeightUpdateMessage], version: int) -> UpdateWeightsResponse:
        async def gen() -> AsyncIterator[WeightUpdateMessage]:
            for m in messages:
                yield m

        async with insecure_channel(self.target) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            for attempt in range(1, 6):
                try:
                    resp: UpdateWeightsResponse = await stub.UpdateWeights(gen(), timeout=self.timeout_s)
                    return resp
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                            or attempt == 5:
                        raise RuntimeError(f"weight push of version {version} failed: "
                                           f"{exc.code().name}: {exc.details()}") from exc
                    log.warning("weight push attempt %d failed (%s); retrying", attempt, exc.code().name)
                    await asyncio.sleep(0.5 * attempt)
        raise AssertionError("unreachable")
