"""Conversions between the inference gRPC service's messages and the engine's types: a Generate request's
:class:`GenerationInput`, a ScoreTokens request's (one per sequence), and a finished sample's message."""

from __future__ import annotations

import asyncio

from relayrl.common.pb import inference_pb2 as pb
from relayrl.inference.engine import GenerationInput, SampleOutput
from relayrl.inference.serving import InferenceService, LimitExceeded, SamplingError


async def generation_input(service: InferenceService, request: pb.GenerateRequest) -> GenerationInput:
    """The engine's input for a gRPC request; ValueError for a malformed one."""
    kind = request.WhichOneof("prompt")
    if kind == "prompt_text":
        ids = await service.tokenize_cached(request.prompt_text)
    elif kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
    elif kind == "prompt_messages":
        messages = [{"role": m.role, "content": m.content} for m in request.prompt_messages.messages]
        ids = await asyncio.to_thread(service.render_chat, messages)
    else:
        raise ValueError("one of prompt_text, prompt_token_ids or prompt_messages is required")
    if request.suffix_text:  # token-in/token-out: the observation's ids after the exact ids of earlier turns
        ids = [*ids, *await service.tokenize_cached(request.suffix_text)]
    s = request.sampling
    return service.check(
        GenerationInput(
            prompt_ids=ids,
            n=s.n or 1,
            temperature=s.temperature if s.temperature != 0 else 1.0,
            top_p=s.top_p if s.top_p != 0 else 1.0,
            top_k=s.top_k,
            max_new_tokens=s.max_new_tokens,
            stop=list(s.stop),
            stop_token_ids=list(s.stop_token_ids),
            seed=s.seed if s.HasField("seed") else None,
            ignore_eos=s.ignore_eos,
        )
    )


def score_inputs(service: InferenceService, request: pb.ScoreTokensRequest) -> list[GenerationInput]:
    """The engine's inputs of a ScoreTokens request (one per sequence); ValueError (LimitExceeded) for a bad one."""
    if len(request.sequences) > service.cfg.max_samples_per_request:
        raise LimitExceeded(
            f"{len(request.sequences)} sequences to score, limit is max_samples_per_request="
            f"{service.cfg.max_samples_per_request}"
        )
    inputs = []
    for i, seq in enumerate(request.sequences):
        if not seq.prompt_token_ids or not seq.completion_token_ids:
            raise ValueError(f"sequence {i}: prompt and completion need at least one token each")
        try:
            inputs.append(
                service.check(
                    GenerationInput(
                        prompt_ids=[*seq.prompt_token_ids, *seq.completion_token_ids],
                        max_new_tokens=1,
                        temperature=seq.temperature if seq.temperature != 0 else 1.0,
                        prompt_logprobs=0,
                    )
                )
            )
        except SamplingError as exc:  # named as the request names it
            raise SamplingError(f"sequences[{i}].{exc.field}", exc.value, exc.rule) from exc
    return inputs


def sample_message(s: SampleOutput) -> pb.Sample:
    return pb.Sample(
        token_ids=s.token_ids,
        logprobs=s.logprobs,
        weight_versions=s.weight_versions,
        finish_reason=s.finish_reason,
        text=s.text,
    )


def generate_response(
    request: pb.GenerateRequest, inp: GenerationInput, samples: list[SampleOutput]
) -> pb.GenerateResponse:
    """The answer to ``request`` (checked as ``inp``) once its ``samples`` ended."""
    return pb.GenerateResponse(
        request_id=request.request_id, prompt_token_ids=inp.prompt_ids, samples=[sample_message(s) for s in samples]
    )
