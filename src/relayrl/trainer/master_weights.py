"""An optimizer (AdamW, or any of relayrl.trainer.optim) with float32 master weights for parameters held in
bfloat16 / float16.

With ``model.dtype: bfloat16`` and full fine-tuning, the model's parameters are bfloat16 (the forward, the backward
and what inference serves). AdamW stepping them directly would keep its moments in bfloat16 and add each update to a
bfloat16 weight: an update smaller than half a unit in the last place (2^-8 relative, 0.4 %) rounds away and is lost
for good, step after step. Here the optimizer steps a float32 copy of every low-precision parameter (its moments are
float32 too) and writes the copy back, rounded, into the model after each step: small updates accumulate in the
master copy until they move the bfloat16 weight. Float32 parameters (LoRA adapters over a bfloat16 base, or a float32
model) are stepped in place as before.

The master copies travel with the optimizer's ``state_dict`` (``master_weights``), so a resumed run continues from the
float32 values, not from the rounded weights of the checkpointed model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights(torch.optim.Optimizer):
    """Mixed into an optimizer class by :func:`with_master_weights`: it steps float32 masters of the low-precision
    ``params`` (the others as they are)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], **kwargs: Any) -> None:
        self.model_params = list(params)
        self.masters = [p.detach().float().clone() if p.dtype in LOW_PRECISION else p for p in self.model_params]
        super().__init__(self.masters, **kwargs)

    @property
    def low_precision(self) -> int:
        """How many parameters have a float32 master copy."""
        return sum(m is not p for p, m in zip(self.model_params, self.masters, strict=True))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        for p, m in zip(self.model_params, self.masters, strict=True):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        loss = super().step(closure)
        for p, m in zip(self.model_params, self.masters, strict=True):
            if m is not p:
                p.copy_(m)  # round to the parameter's dtype (round to nearest even)
                m.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["master_weights"] = {
            i: m.detach().clone()
            for i, (p, m) in enumerate(zip(self.model_params, self.masters, strict=True))
            if m is not p
        }
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        masters = state.pop("master_weights", None)
        super().load_state_dict(state)
        if masters is None:  # a checkpoint of a run without masters: start them from the model's weights
            for p, m in zip(self.model_params, self.masters, strict=True):
                if m is not p:
                    m.copy_(p)
            return
        for i, (p, m) in enumerate(zip(self.model_params, self.masters, strict=True)):
            if m is not p:
                m.copy_(masters[i])
                p.copy_(m)


_WITH_MASTERS: dict[type[torch.optim.Optimizer], type[MasterWeights]] = {}


def with_master_weights(cls: type[torch.optim.Optimizer]) -> type[MasterWeights]:
    """``cls`` (e.g. torch.optim.AdamW) over float32 masters of the low-precision parameters it is given (one
    class per optimizer class)."""
    if cls not in _WITH_MASTERS:
        _WITH_MASTERS[cls] = type(f"MasterWeight{cls.__name__}", (MasterWeights, cls), {})
    return _WITH_MASTERS[cls]


MasterWeightAdamW = with_master_weights(torch.optim.AdamW)
