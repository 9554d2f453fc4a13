"""`cast_lm_head_to_fp32`: the output projection keeps its weight in float32 and projects in float32, outside
autocast, so bf16/fp16 training still gets float32 logits (shared spec §1.2; TRL 1.16).

The head becomes a `Float32Head` (an `nn.Linear` whose forward turns autocast off); every path that projects
honours it: the model's own forward (generation, the plain training pass), the tiled head of the training pass
(`grpo.algo.logprobs.chunked_logps_and_entropy` with float32 compute) and the lean decoder. With tied embeddings the
shared weight is float32 too, so the embedding's output is cast back to the model's dtype (a forward hook), as TRL
does. An adapter (PEFT) on the head is refused: the head's weight, not the adapter, would be projected.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from grpo.config import ResolvedConfig
from grpo.models import lora
from grpo.models.modeling import unwrap


class Float32Head(torch.nn.Linear):
    """An output projection computed in float32 whatever autocast says."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(hidden.float(), self.weight.float(), bias)


def is_fp32_head(module: Any) -> bool:
    return isinstance(module, Float32Head)


def apply(args: ResolvedConfig, *models: Any) -> None:
    """With `cast_lm_head_to_fp32`, make each given model's (policy, reference; None skipped) head float32."""
    if not args.cast_lm_head_to_fp32:
        return
    for model in models:
        if model is not None:
            cast_lm_head_to_fp32(model)


def cast_lm_head_to_fp32(model: Any) -> None:
    inner = unwrap(model)
    head = inner.get_output_embeddings()
    if lora.is_adapter_layer(head):
        raise ValueError(
            "GRPOConfig.cast_lm_head_to_fp32=True cannot be used with a PEFT adapter on the output head (lm_head in "
            "target_modules or modules_to_save): the head's own weight would be projected in float32 and the "
            "adapter ignored. Remove lm_head from the adapter's modules, or set cast_lm_head_to_fp32=False."
        )
    if is_fp32_head(head):
        return
    if type(head) is not torch.nn.Linear:
        raise ValueError(
            f"GRPOConfig.cast_lm_head_to_fp32=True needs a plain linear output head; {type(inner).__name__}'s is a "
            f"{type(head).__name__}. Set cast_lm_head_to_fp32=False."
        )
    dtype = head.weight.dtype
    embedding = inner.get_input_embeddings()
    head.float()
    head.__class__ = Float32Head  # the same module (parameters, hooks, ties), another forward
    if embedding is not None and embedding.weight is head.weight and dtype != torch.float32:
        # tied: the embedding's weight is float32 now; its output goes on in the model's own dtype
        embedding.register_forward_hook(lambda module, inputs, output: output.to(dtype))
