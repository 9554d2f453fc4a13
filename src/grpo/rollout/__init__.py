"""Generation engines behind one interface (`grpo.rollout.base`): prompts in, completions with their sampling
log-probs out.

- `plain.TransformersEngine`: `model.generate`, every `generation_kwargs` key transformers knows;
- `fast.FastEngine`: our own decode loop (prefix sharing, shrinking batch), on `lean_decoder.LeanDecoder` for
  Llama-family models;
- engines that sample elsewhere (vLLM, a generation server) implement the same `generate` / `sync_weights`.

`build_engine` picks one from the config and logs why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from grpo.rollout import fast
from grpo.rollout.base import Engine, Prompt, Request, Rollout
from grpo.rollout.plain import TransformersEngine

logger = logging.getLogger("grpo")
__all__ = ["Engine", "Prompt", "Request", "Rollout", "build_engine"]


def build_engine(model: Any, tokenizer: Any, args: Any, stop_ids: list[int], accelerator: Any) -> Engine:
    """The fast engine where it applies, else the plain `model.generate` engine; the log says which and why."""
    reason = fast.unsupported_reason(model, args)
    if reason is None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
        engine: Engine = fast.FastEngine(
            model, tokenizer, args, stop_ids, autocast=accelerator.autocast, compute_dtype=dtype
        )
        logger.info("Generating with grpo's fast engine.")
        return engine
    logger.info("Generating with the plain transformers engine: %s.", reason)
    return TransformersEngine(model, tokenizer, args, stop_ids, autocast=accelerator.autocast)
