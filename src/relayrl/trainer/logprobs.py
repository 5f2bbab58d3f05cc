"""log pi(target) of a micro-batch without full-vocabulary float32 logits of all its positions at once.

The plain way (:func:`token_logprobs` on the model's logits) holds ``[B, L, V]`` logits for
every position of every padded row, a float32 copy divided by the temperature, the log-softmax (kept for the
backward) and, in the backward, their gradients: several ``[B, L, V]`` float32 tensors at once (32 rows x 80
positions x 49,152 tokens is 0.5 GB each). Two cuts, both exact up to float rounding:

- only the positions trained on (``mask != 0``) reach the output layer: a forward pre-hook on the model's output
  embeddings selects their hidden states, so the logits are ``[1, N, V]`` for the N completion tokens instead of
  ``[B, L, V]`` (prompt and padding positions included). Whatever the model does after its output layer
  (soft-capping, scaling) still runs, on those positions only;
- the log-softmax runs in chunks of ``chunk`` positions (:class:`ChunkedTokenLogprobs`): the forward keeps only
  each position's log-sum-exp, the backward recomputes a chunk's softmax and writes its gradient into one
  ``[N, V]`` tensor, so the float32 copy, the softmax and its gradient exist one chunk at a time.

Positions left out get the micro-batch's behaviour logprob: finite, ratio 1 and KL 0 there, and masked out of
every loss and statistic anyway (:class:`relayrl.trainer.losses.tokens.Tokens`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.function import once_differentiable


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at targets. logits [B, T, V], targets [B, T], temperature
    [B] (one per row) or [B, T] (one per position, for packed rows)."""
    assert logits.shape[:2] == targets.shape
    assert temperature.shape in (logits.shape[:1], logits.shape[:2]), (temperature.shape, logits.shape)
    scale = temperature.view(-1, 1, 1) if temperature.dim() == 1 else temperature.unsqueeze(-1)
    scaled = logits.float() / scale
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log softmax(logits / temperature)[target] per position, ``chunk`` positions at a time (float32).

    logits ``[N, V]`` (any float dtype), targets ``[N]`` long, temperature ``[N]`` float32; returns ``[N]``
    float32. Gradient: ``g * (onehot(target) - softmax) / temperature``, as log_softmax's, one chunk at a time.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        n = logits.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for s in range(0, n, chunk):
            part = slice(s, s + chunk)
            x = logits[part].float() / temperature[part, None]
            lse[part] = torch.logsumexp(x, dim=-1)
            out[part] = x.gather(1, targets[part, None]).squeeze(1) - lse[part]
            del x
        ctx.save_for_backward(logits, targets, temperature, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, targets, temperature, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            part = slice(s, s + ctx.chunk)
            t = temperature[part, None]
            g = grad_out[part, None].float()
            d = torch.exp(logits[part].float() / t - lse[part, None])  # the softmax of the chunk
            d.mul_(-g).scatter_add_(1, targets[part, None], g)
            grad[part] = d.div_(t)
            del d
        return grad, None, None, None


def chunked_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor, chunk: int
) -> torch.Tensor:
    """:class:`ChunkedTokenLogprobs` of flat ``[N, V]`` logits."""
    if chunk < 1:
        raise ValueError(f"chunk {chunk} must be >= 1")
    out: torch.Tensor = ChunkedTokenLogprobs.apply(logits, targets, temperature.to(torch.float32), chunk)
    return out


@contextmanager
def output_positions(model: Any, keep: torch.Tensor) -> Iterator[None]:
    """While open, ``model``'s output layer sees only the hidden states at ``keep`` (``[B, L]`` bool), as one
    row ``[1, N, H]``."""
    head = model.get_output_embeddings()

    def select(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        if tuple(hidden.shape[:2]) != tuple(keep.shape):
            raise RuntimeError(
                f"the output layer got hidden states {tuple(hidden.shape)}, expected "
                f"{tuple(keep.shape)} positions: set trainer.logprob_chunk_positions to 0"
            )
        return (hidden[keep].unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def selected_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    mask: torch.Tensor,
    filler: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """log pi(target) ``[B, L]`` at the positions where ``mask != 0`` (both cuts above), ``filler`` elsewhere;
    ``temperature`` ``[B]`` (one per row) or ``[B, L]``. ``chunk < 1`` or a model without output embeddings:
    the plain way, every position."""
    if chunk < 1 or model.get_output_embeddings() is None:
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits
        return token_logprobs(logits, targets, temperature)
    keep = mask != 0
    with output_positions(model, keep):
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits
    temp = temperature if temperature.dim() == 2 else temperature[:, None].expand(targets.shape)
    lp = chunked_token_logprobs(logits.reshape(-1, logits.shape[-1]), targets[keep], temp[keep], chunk)
    return filler.detach().to(lp.dtype).masked_scatter(keep, lp)
