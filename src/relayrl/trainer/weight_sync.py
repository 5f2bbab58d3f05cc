"""Publishing weights to inference through a :class:`~relayrl.trainer.transports.Transport`, verified.

Inference validates the whole update (its checksum against the manifest, names, shapes, finite values) before an
atomic swap. Every publication is then verified exactly where the engine can (native): after the swap it confirms
that every module path of every updated parameter, tied aliases included, reads the very tensors whose checksum
matched, and answers that checksum (``served_sha256``), which must be the one the trainer computed over what it
sent; a module that reads anything else (``served_mismatch``: a reload that left a copy behind) fails the
publication. On the first publication, every ``probe_every``-th after it, and on every one to an engine that cannot
confirm (vLLM), inference also returns the logprobs of the probe batch under the new weights, which
:class:`WeightPublisher` compares with the logprobs of the very snapshot it sent: an end-to-end check of the
forward pass at the cost of one forward on each side. Either check failing raises
:class:`WeightVerificationError`.

The push goes through the typed client (``InferenceClient.update_weights``): a push that timed out or met
UNAVAILABLE may have landed, so the client asks the served version before retrying. A landed push whose answer
was lost comes back unverified (``PushResult.verified`` false): the caller verifies the same snapshot by pushing
it again as a fresh version (inference refuses a version it already serves).

A sharded model (FSDP2) is published by streaming: :meth:`WeightPublisher.gather` runs on every rank, one
all-gather per trained parameter in name order, and rank 0 writes each full tensor into a file of the transport's
spool and into its checksum as it arrives, then drops it (relayrl.trainer.weight_files); what rank 0 pushes and
probes is that file (its tensors read back through a memory map), so no rank holds more than one full tensor
beside its shards.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from torch.func import functional_call

from relayrl.client import InferenceClient
from relayrl.common.probe import WeightVerificationError, compare_probe, probe_logprobs, probe_sequences
from relayrl.common.tensor_views import packed_copy
from relayrl.common.weights import TensorSpec
from relayrl.config.tls import TlsConfig
from relayrl.trainer.fanout import fan_out, prepare_legs
from relayrl.trainer.parallel_dims import is_sharded
from relayrl.trainer.transports import Transport, Weights
from relayrl.trainer.weight_files import MappedWeights, StreamedWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishTimings:
    """Where one publication's seconds went (rank 0; the last push of a publication).

    - ``serialise_s``: the trainer's snapshot of the parameters plus the transport's preparation (checksum; chunks
      for grpc_stream, the file for shared_path / shared_memory); sharded, the gather, which writes and hashes;
    - ``transfer_s``: the UpdateWeights call minus inference's own work below: the bytes on the wire (grpc_stream),
      inference receiving and checking chunks, gRPC and connection overhead;
    - ``swap_s``: inference assembling the update (reading a shared file, checksum, finite check) and swapping it in
      (waiting for the engine's step boundary included);
    - ``probe_s``: inference scoring the probe plus the trainer scoring it on its snapshot and comparing;
    - ``total_s``: the whole publication, wall clock (the snapshot included); ``bytes``: the update's size.
    """

    serialise_s: float = 0.0
    transfer_s: float = 0.0
    swap_s: float = 0.0
    probe_s: float = 0.0
    total_s: float = 0.0
    bytes: int = 0


@dataclass(frozen=True)
class PushResult:
    version: int
    bytes_sent: int
    seconds: float
    probe_max_diff: float | None  # None: no probe this time (or the answer was lost)
    timings: PublishTimings = PublishTimings()
    served_verified: bool = False  # the engine confirmed that its modules read exactly the sent tensors

    @property
    def verified(self) -> bool:
        """False: the push landed but its answer was lost, or nothing verified it."""
        return self.probe_max_diff is not None or self.served_verified


class _Snapshot:
    """The model evaluated with a frozen copy of its parameters (a callable like the model)."""

    def __init__(self, model: Any, params: Mapping[str, torch.Tensor]) -> None:
        self.model = model
        self.params = params

    def __call__(self, **kwargs: Any) -> Any:
        return functional_call(self.model, dict(self.params), args=(), kwargs=kwargs)


class WeightPublisher:
    def __init__(
        self,
        model: Any,
        device: torch.device,
        target: str | Sequence[str],
        transport: Transport,
        timeout_s: float,
        probe: list[list[int]],
        probe_tolerance: float | None,
        token: str = "",
        tls: TlsConfig | None = None,
        plain_model: Any | None = None,
        probe_every: int = 1,
    ) -> None:
        self.model = model
        # FSDP2 (trainer.distributed.dp_shard > 1): the parameters are shards; every rank gathers them (gather) and
        # rank 0 streams the full tensors into a file, scoring the probe with ``plain_model`` (an unsharded copy of
        # the architecture whose own parameters are never used) on the file's tensors
        self.sharded = plain_model is not None or is_sharded(model)
        self._clients: dict[str, InferenceClient] = {}  # the pushes' channel to each replica, opened by the first
        self.plain_model = plain_model
        # the last gather's file: what the publication and any re-push of it (a watchdog's) send, until the next
        self._gathered: MappedWeights | None = None
        # the trained parameters, found once: walking a LoRA model's module tree costs more than copying an adapter
        self._trained: dict[str, torch.nn.Parameter] | None = None
        self.tls = tls  # the run's tls section: the channel to inference is TLS when it is on
        self.token = token  # the weights token: inference accepts updates only with it
        self.device = device
        # the inference replicas: each gets every version (prepared once), and each answer is checked
        self.targets = [target] if isinstance(target, str) else list(target)
        self.failed_pushes: dict[str, int] = dict.fromkeys(self.targets, 0)  # per replica: pushes that failed
        self.behind: set[str] = set()  # replicas whose last push failed: skipped until the watchdog catches them up
        self.transport = transport  # the publication's (a sharded gather spools and hashes by it)
        self.transports: dict[str, Transport] = dict.fromkeys(self.targets, transport)  # replica -> its transport
        self.timeout_s = timeout_s
        self.probe = probe
        self.probe_tolerance = probe_tolerance
        # the probe runs on the first push, every probe_every-th after it (0: never again) and on every push while
        # the engine does not confirm the served weights itself (served_sha256)
        self.probe_every = probe_every
        self.answered = 0  # pushes answered so far
        # pushes sent again after a refusal (RESOURCE_EXHAUSTED: the weights server's budget was full) or a failure
        # (UNAVAILABLE, DEADLINE_EXCEEDED): relayrl_trainer_weight_push_retries
        self.push_retries = 0
        self.engine_confirms = False  # the last answer carried the engine's served-weights check
        self.dtype = next(model.parameters()).dtype
        # held by optimizer steps (VersionPublication.locked) and by the probe, which evaluates the live module
        # with the snapshot's tensors swapped in: a push overlapping training never runs inside an optimizer step
        self.model_lock = threading.Lock()

    @staticmethod
    def default_probe(model: Any, tokenizer: Any, sequences: int, tokens: int, seed: int) -> list[list[int]]:
        vocab = int(model.get_input_embeddings().num_embeddings)
        special = [i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None]
        return probe_sequences(vocab, sequences, tokens, seed, exclude=special)

    def probe_due(self) -> bool:
        every = self.probe_every
        return not self.engine_confirms or self.answered == 0 or (every > 0 and self.answered % every == 0)

    def snapshot(self) -> Weights:
        """A copy of the trained parameters as they are now (the caller keeps training from changing them
        meanwhile): every parameter in full fine-tuning, the adapter only with LoRA (the frozen base never moves).
        Sharded: the file of the last :meth:`gather` (no copy)."""
        if self.sharded:
            if self._gathered is None:
                raise RuntimeError("no gathered weights to publish: gather() runs on every rank before a publication")
            return self._gathered
        if self._trained is None:  # the same Parameter objects for the whole run (optimizers hold them too)
            self._trained = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        # one buffer, tensors back to back in name order: one copy, and the transport sees one storage
        return packed_copy(self._trained)

    def gather(self, keep: bool) -> None:
        """Every rank, at the same point (FSDP2): one all-gather per trained parameter, in name order (the same
        on every rank, and the order of the file and of its checksum). ``keep`` (rank 0) writes each full tensor
        into a new spool file and its checksum, then drops it, as the others drop theirs at once: no rank ever holds
        more than one full tensor beside its shards. A write that fails does not stop the gathering (the other
        ranks run the same collectives): it raises once every parameter went by."""
        params = sorted(((n, p) for n, p in self.model.named_parameters() if p.requires_grad), key=lambda np: np[0])
        # hashed as the transport's manifests are (XXH3-128 for shared_memory, SHA-256 otherwise), in the same pass
        specs = {n: TensorSpec(p.dtype, tuple(p.shape)) for n, p in params}
        writer = StreamedWriter(self.transport.spool_path(), specs, self.transport.checksum_algorithm) if keep else None
        error: Exception | None = None
        try:
            for name, p in params:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                if writer is not None and error is None:
                    try:
                        writer.add(name, full)
                    except (OSError, ValueError) as exc:
                        error = exc
                del full
        except BaseException:  # a collective failed: no partial file stays behind
            if writer is not None:
                writer.abort()
            raise
        if writer is None:
            return
        if error is not None:
            writer.abort()
            raise RuntimeError(f"writing the gathered weights to {writer.path} failed: {error}") from error
        previous, self._gathered = self._gathered, writer.finish()
        if previous is not None:
            previous.release()  # a push still reading it keeps its open file

    def expected_probe(self, params: Weights) -> torch.Tensor:
        with self.model_lock:
            was_training = self.model.training
            self.model.eval()
            try:
                model = self.plain_model if self.plain_model is not None else self.model
                device = next(model.parameters()).device
                # a gathered file: its tensors read through a memory map of it, no copy in this process's memory
                tensors = params.tensors() if isinstance(params, MappedWeights) else params
                return probe_logprobs(_Snapshot(model, tensors), self.probe, device)
            finally:
                self.model.train(was_training)

    async def push(self, params: Weights, version: int, only: Sequence[str] | None = None) -> PushResult:
        """Send ``params`` as ``version`` to the replicas (``only`` these; else every one not ``behind``, or all when
        every one is), prepared once per transport in use (relayrl.trainer.fanout); verify what each serves by the
        engine's served-weights check and, when due, the probe. Raises WeightVerificationError when a replica serves
        something else, and RuntimeError when the push failed on every replica. A replica whose push failed, or
        that had not answered 5 s (at least three times the first answer's time) after another answered, is
        ``behind`` (logged and counted): publications skip it and the watchdog pushes to it alone once it answers
        again. An unverified result when a push landed but its answer was lost (or neither check covered it). The
        trainer's probe is scored once, while the update travels."""
        t0 = time.perf_counter()
        targets = list(only) if only else [t for t in self.targets if t not in self.behind] or list(self.targets)
        probe = self.probe if self.probe_due() else []
        legs = await asyncio.to_thread(prepare_legs, params, version, probe, self._by_transport(targets))
        t_prepared = time.perf_counter()
        expected_task = asyncio.create_task(asyncio.to_thread(self.expected_probe, params)) if probe else None
        try:
            sent = await fan_out(legs, self._send, version)
        finally:
            t_answered = time.perf_counter()
            expected = await expected_task if expected_task is not None else None
        answers = self._answers(targets, [sent[t] for t in targets], version)
        sha = {t: leg.sha256 for leg in legs for t in leg.targets}
        checks = [self._check(resp, sha[t], version, expected) for t, resp in answers]
        served = all(confirmed for confirmed, _ in checks)  # (False for an answer that was lost)
        self.engine_confirms = served
        diffs = [d for _, d in checks]
        diff = None if None in diffs else max(d for d in diffs if d is not None)
        replies = [r for _, r in answers]
        sent_bytes = max((int(r.bytes_received) for r in replies if r is not None), default=0)
        if None in replies or (diff is None and not served):
            log.warning("weight version %d landed unverified on a replica (answer lost, or nothing checked)", version)
            return PushResult(version, sent_bytes, t_answered - t0, None)
        t_compared = time.perf_counter()
        for leg in legs:
            await asyncio.to_thread(leg.transport.after_success, version)
        total = time.perf_counter() - t0
        slowest = max(replies, key=lambda r: r.assemble_s + r.swap_s + r.probe_s)  # the phases of the last to swap
        timings = PublishTimings(  # the phases add up to total_s (the trainer's probe overlaps the transfer)
            serialise_s=(t_prepared - t0) + (total - (t_compared - t0)),
            transfer_s=max(t_answered - t_prepared - (slowest.assemble_s + slowest.swap_s + slowest.probe_s), 0.0),
            swap_s=slowest.assemble_s + slowest.swap_s,
            probe_s=slowest.probe_s + (t_compared - t_answered),
            total_s=total,
            bytes=sent_bytes,
        )
        return PushResult(version, sent_bytes, total, diff, timings, served)

    def _by_transport(self, targets: Sequence[str]) -> list[tuple[Transport, list[str]]]:
        """``targets`` grouped by their transport, in the order each transport first appears."""
        groups: dict[int, tuple[Transport, list[str]]] = {}
        for t in targets:
            groups.setdefault(id(self.transports[t]), (self.transports[t], []))[1].append(t)
        return list(groups.values())

    def _answers(self, targets: Sequence[str], sent: list[Any], version: int) -> list[tuple[str, Any]]:
        """The answers of the replicas the push reached (None: landed, answer lost); RuntimeError when it reached
        none. A replica whose push failed is logged, counted and ``behind``; one that answered is not."""
        answers: list[tuple[str, Any]] = []
        errors: list[BaseException] = []
        for target, outcome in zip(targets, sent, strict=True):
            if isinstance(outcome, RuntimeError):
                self.failed_pushes[target] += 1
                self.behind.add(target)
                errors.append(outcome)
                if len(self.targets) > 1:
                    log.warning("weight version %d did not reach replica %s: %s", version, target, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                self.behind.discard(target)
                answers.append((target, outcome))
        if not answers:
            raise errors[0]
        if any(a is not None for _, a in answers):
            self.answered += 1
        return answers

    def _check(self, resp: Any, sha256: str, version: int, expected: torch.Tensor | None) -> tuple[bool, float | None]:
        """One replica's answer: (its engine confirmed the served weights, the probe's max difference or None)."""
        if resp is None:
            return False, None
        served = check_served(resp, sha256, version)
        if expected is None:
            return served, None
        return served, compare_probe(expected, resp.probe_logprobs, self.dtype, version, self.probe_tolerance)

    async def _send(self, target: str, messages: Sequence[Any], version: int) -> Any:
        client = self._clients.get(target)
        if client is None:  # one channel per replica for every push (it reconnects by itself after a restart)
            client = self._clients[target] = InferenceClient(
                target, timeout_s=10.0, retries=4, backoff_s=0.5, token=self.token, tls=self.tls
            )
        try:
            return await client.update_weights(messages, version, self.timeout_s, on_retry=self._count_retry)
        except grpc.aio.AioRpcError as exc:
            raise RuntimeError(f"weight push of version {version} failed: {exc.code().name}: {exc.details()}") from exc

    def _count_retry(self, code: grpc.StatusCode) -> None:
        self.push_retries += 1

    async def close(self) -> None:
        """Close the push channels (the trainer is closing); a later push opens new ones."""
        clients, self._clients = self._clients, {}
        await asyncio.gather(*(c.close() for c in clients.values()))


def check_served(resp: Any, sent_sha256: str, version: int) -> bool:
    """True when inference confirmed that its modules read exactly the tensors that hash to what was sent; raises
    WeightVerificationError when it found a module reading other weights, or confirmed another checksum."""
    if resp.served_mismatch:
        raise WeightVerificationError(
            f"inference serves weights that disagree with the trainer's at version "
            f"{version}: {resp.served_mismatch} does not read the update's tensors"
        )
    if resp.served_sha256 and resp.served_sha256 != sent_sha256:
        raise WeightVerificationError(
            f"inference serves weights that disagree with the trainer's at version "
            f"{version}: checksum {resp.served_sha256[:12]} served, {sent_sha256[:12]} sent"
        )
    return bool(resp.served_sha256)
