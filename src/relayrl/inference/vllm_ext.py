"""The vLLM worker extension relayrl loads into vLLM's workers (``worker_extension_cls``).

It reloads weights from tensors handed over in process (HF parameter names, as the trainer sends them) and then
fixes what vLLM's in-place reload leaves behind: with tied embeddings the output layer is not reloaded by
name, and on the CPU backend its GEMM was dispatched at load time with a packed copy of the old weight. Without
the fix logprobs after an update are off by up to 10 on the tiny models (measured; the probe catches it).
It also tells which modules vLLM serves LoRA on (for ``model.lora.target_modules``). Imported by vLLM inside its
worker; keep it free of relayrl imports beyond typing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class RelayrlWorkerExtension:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def relayrl_load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        model = self.model_runner.model
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        config = getattr(model, "config", None)
        lm_head = getattr(model, "lm_head", None)
        inner = getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if lm_head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
            return
        if lm_head.weight is not embed.weight:  # re-tie if the reload replaced the shared parameter
            lm_head.weight = embed.weight
        method = getattr(lm_head, "quant_method", None)
        if method is not None:  # re-dispatch the output GEMM with the new (shared) weight
            method.process_weights_after_loading(lm_head)

    def relayrl_lora_modules(self) -> list[str]:
        """The module names an adapter may target: vLLM's LoRA modules except the embeddings and the output layer
        (whose adapters relayrl does not verify through vLLM), packed layers expanded to the Hugging Face names as
        vLLM expands them when it loads an adapter (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``)."""
        manager = self.model_runner.lora_manager._adapter_manager
        embeddings = set(getattr(manager.model, "embedding_modules", None) or ())
        names: list[str] = []
        for module in manager.supported_lora_modules:
            if module not in embeddings:
                names.extend(manager.packed_modules_mapping.get(module, [module]))
        return sorted(set(names))
