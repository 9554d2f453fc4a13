"""Grouped key/value heads read as they are by CPU attention.

On CPU, transformers' SDPA attention can read the key/value heads as they are (`enable_gqa`) instead of repeating
them for every query head: CPU's flash kernel takes grouped heads with a mask and gives the same numbers (tested,
float32 rtol 1e-5), ~15% faster in the training pass, without the repeated keys and values the backward would
keep. transformers reads the switch, `TRANSFORMERS_SDPA_FORCE_GQA`, at each attention call; grpo sets it once
for the process (logged) when the policy is on the CPU and has grouped heads. (On CUDA a mask would send grouped
heads to the slow math kernel, so there it is not set.)
"""

from __future__ import annotations

from typing import Any

from grpo.base.process_env import set_for_dependency
from grpo.models.modeling import attention_shapes, unwrap

SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


def unsupported_reason(model: Any) -> str | None:
    """Why grouped heads should not be read as they are for this model (None when they should)."""
    model = unwrap(model)
    config = getattr(model, "config", None)
    shapes = attention_shapes(config) if config is not None else None  # each layer's (Gemma 4's layers differ)
    if not shapes or all(kv_heads == heads for heads, kv_heads, _ in shapes):
        return "the model has one key/value head per query head"
    if next(model.parameters()).device.type != "cpu":
        return "the model is not on the CPU"
    return None


def use_grouped_heads(model: Any) -> bool:
    """Set the switch for this process when it applies to `model`; returns whether it is on."""
    if unsupported_reason(model) is not None:
        return False
    return set_for_dependency(SWITCH, "1", "CPU attention reads grouped key/value heads without repeating them")
