"""The policy's weights as (name, tensor) pairs under the names of its Hugging Face checkpoint: what an engine with a
copy of the model (vLLM) loads before it samples again.

    with checkpoint_weights(model) as weights:   # every process enters: gathering a sharded model is collective
        engine.load(weights)

- a sharded model (FSDP2, FSDP1, DeepSpeed ZeRO-3) is gathered for the copy (`sharding.full_parameters`) and
  sharded again after;
- wrapper segments (`_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`, DDP's `module.`) are dropped;
- a PEFT model gives its merged weights (`lora.merged_parameters`: base + adapter delta, computed into copies) under
  the base model's names (no `base_model.model.`, no `.base_layer`, no adapter parameters, `modules_to_save`
  copies under the original name);
- the buffers a checkpoint holds come too (`persistent_buffers`: Gemma 4's layer scalars), since an engine that
  starts from dummy weights has random ones.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

from grpo.distributed.sharding import full_parameters
from grpo.models import lora
from grpo.models.modeling import unwrap

_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def checkpoint_name(name: str, peft: bool) -> str | None:
    """A parameter's name in the model's Hugging Face checkpoint; None for parameters that are not in it (PEFT
    adapters, and the frozen originals that `modules_to_save` copies replace)."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    if not peft:
        return name
    if "lora_" in name or "original_module" in name:
        return None
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    return name.replace(".modules_to_save.default", "")


@contextlib.contextmanager
def checkpoint_weights(model: torch.nn.Module) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """The policy's whole weights under checkpoint names, valid inside the block (see the module docstring)."""
    peft = lora.is_peft_model(model)
    inner = unwrap(model, keep_peft=True)
    with full_parameters(inner):
        parameters = lora.merged_parameters(inner) if peft else inner.named_parameters()
        yield _renamed(itertools.chain(parameters, persistent_buffers(inner)), peft)


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's buffers that its state dict (and so its checkpoint) holds, named as in the model: its persistent
    ones (Gemma 4's per-layer scalars; a rotary embedding's frequencies are not)."""
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buffer


def _renamed(named: Iterator[tuple[str, torch.Tensor]], peft: bool) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for name, tensor in named:
        target = checkpoint_name(name, peft)
        if target is None or target in seen:
            continue
        seen.add(target)
        yield target, tensor.detach()
