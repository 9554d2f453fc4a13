"""LoRA through PEFT, the only module that imports `peft` (lazily: it is an optional dependency).

- `peft_config=LoraConfig(...)` wraps the policy; a model that already is a `PeftModel` is used as it is. Only
  the adapter parameters require gradients, so only they reach the optimizer.
- With beta > 0 the reference policy is the same model with its adapters disabled: no second copy of the
  weights (`adapters_disabled`).
- Saving writes the adapter (PEFT's `save_pretrained`); resuming loads it back (`load_adapter`).
- An engine with its own copy of the weights (vLLM) gets the merged weights (`merged_parameters`: base + delta
  computed into copies, the model's own weights untouched).
- The lean decoder reads each module through `active_module` (a `modules_to_save` copy where one is active) and each
  linear's weight through `merged_linear` (a LoRA layer's base weight plus its active adapters' deltas, summed in
  float32 into a new tensor and rounded once, by the decoder's own cast; the adapters, the base weights and the
  optimizer state are untouched). `lean_problem` names what it cannot merge (DoRA and other variants, an adapter
  bias, a non-Linear base).
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PreTrainedModel

from grpo.models.modeling import unwrap


def is_peft_model(model: Any) -> bool:
    model = unwrap(model, keep_peft=True)
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def is_adapter_layer(module: Any) -> bool:
    """Whether the module is a PEFT layer (an adapter around a base layer, or a trained copy of one)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils import ModulesToSaveWrapper
    except ImportError:
        return False
    return isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper))


def wrap(
    model: PreTrainedModel, peft_config: Any, gradient_checkpointing: bool, language_targets: list[str] | None = None
) -> torch.nn.Module:
    """The policy with `peft_config`'s adapters added (frozen base, trainable adapters). For a vision-language model
    (`language_targets`: its language model's linear layers), a config that leaves the targets to peft (None) or asks
    for "all-linear" targets the language model only: the vision tower and projector stay as they are."""
    try:
        from peft import PeftConfig, get_peft_model
    except ImportError as err:
        raise ImportError("peft_config needs the peft package: pip install peft") from err
    if not isinstance(peft_config, PeftConfig):
        raise TypeError(
            f"peft_config is a {type(peft_config).__name__}; pass a peft.PeftConfig such as "
            "LoraConfig(r=16, target_modules='all-linear', task_type='CAUSAL_LM')."
        )
    if is_peft_model(model):
        raise ValueError(
            "The model already is a PEFT model and peft_config is set too: pass one of them (the PEFT "
            "model alone trains its own adapters)."
        )
    if language_targets and getattr(peft_config, "target_modules", None) in (None, "all-linear"):
        peft_config = copy.copy(peft_config)
        peft_config.target_modules = set(language_targets)
    if gradient_checkpointing:
        # checkpointed blocks of a frozen base still need an input that requires grad for the adapters' grads
        model.enable_input_require_grads()
    with warnings.catch_warnings():  # peft reads a transformers attribute that transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, peft_config)


@contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """The base model's behaviour (the reference policy) for the duration of the block."""
    with unwrap(model, keep_peft=True).disable_adapter():
        yield


def merged_parameters(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The PEFT model's parameters, named as in the model, with each LoRA layer's base weight replaced by base +
    the active adapters' delta. The deltas are added to copies, never merged in place: merging and unmerging in
    float32 would leave the trained base weights off by rounding after every copy."""
    from peft.tuners.lora import LoraLayer

    model = unwrap(model, keep_peft=True)
    deltas: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or module.merged:
            continue
        adapters = [a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A]
        if any(module.use_dora.get(a, False) for a in adapters):
            raise NotImplementedError(
                f"{name} uses DoRA (use_dora=True), whose merged weight grpo cannot hand to a generation engine "
                "yet: generate in-process (use_vllm=False), or use plain LoRA."
            )
        if adapters:
            # each LoraLayer subclass (Linear, Embedding, Conv*) defines get_delta_weight, LoraLayer itself does not
            parts: list[torch.Tensor] = [module.get_delta_weight(a) for a in adapters]  # type: ignore[attr-defined]
            deltas[f"{name}.base_layer.weight"] = sum(parts[1:], parts[0])
    for name, param in model.named_parameters():
        delta = deltas.get(name)
        yield name, param.detach() if delta is None else param.detach() + delta.to(param.dtype)


def active_module(module: Any) -> Any:
    """The module a forward runs now: a `modules_to_save` wrapper's active copy (its original while adapters are
    disabled or the active adapter has no copy); any other module itself."""
    if type(module).__name__ != "ModulesToSaveWrapper":
        return module
    adapters = list(module.active_adapters)
    if module.disable_adapters or not adapters or any(a not in module.modules_to_save for a in adapters):
        return module.original_module
    return module.modules_to_save[adapters[0]]


def _lora_adapters(module: Any) -> list[str]:
    """The active adapters of a LoRA layer that change its output now (none while disabled or merged in)."""
    if module.disable_adapters or module.merged:
        return []
    return [a for a in module.active_adapters if a in module.lora_A or a in getattr(module, "lora_embedding_A", {})]


def lean_problem(module: Any) -> str | None:
    """Why `merged_linear` cannot give this module's weight (None: a plain Linear, or a LoRA Linear it merges)."""
    module = active_module(module)
    if type(module) is torch.nn.Linear:
        return None
    kind = f"{type(module).__module__}.{type(module).__qualname__}"
    if not _is_lora_linear(module) and is_adapter_layer(module):
        return f"a projection carries a PEFT adapter of another kind ({kind}), whose merged weight is not base + B A"
    if not _is_lora_linear(module):
        return f"a projection is a {kind}, not a plain torch Linear or a LoRA adapter on one (quantization?)"
    if type(module.get_base_layer()) is not torch.nn.Linear:
        return f"a LoRA adapter sits on a {type(module.get_base_layer()).__qualname__}, not a plain torch Linear"
    for adapter in _lora_adapters(module):
        if adapter in module.lora_variant or module.use_dora.get(adapter, False):
            return f"the LoRA adapter {adapter!r} is a variant (DoRA or another) whose weight is not base + B A"
        if module.lora_B[adapter].bias is not None:
            return f"the LoRA adapter {adapter!r} has a bias (lora_bias=True)"
    return None


def _is_lora_linear(module: Any) -> bool:
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:
        return False
    return isinstance(module, LoraLinear)


def merged_linear(module: Any, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a linear as its forward applies them now: a plain Linear's own; a LoRA Linear's base
    weight plus scaling * B A of each active adapter, summed in float32 into a new tensor and rounded once to
    `dtype` (the decoder's compute dtype; None: float32), detached: the module, its adapters and the optimizer's
    state are untouched. Check `lean_problem` first."""
    module = active_module(module)
    if not _is_lora_linear(module):  # a plain Linear, or a subclass of one (the float32 head)
        return module.weight, module.bias
    base = module.get_base_layer()
    adapters = _lora_adapters(module)
    if not adapters:
        return base.weight, base.bias
    weight = base.weight.detach().float().clone()
    for adapter in adapters:
        delta = module.lora_B[adapter].weight.detach().float() @ module.lora_A[adapter].weight.detach().float()
        weight.add_(delta.T if module.fan_in_fan_out else delta, alpha=module.scaling[adapter])
    return (weight if dtype is None else weight.to(dtype)), base.bias


def load_adapter(model: Any, path: str) -> list[str]:
    """Load the adapter weights saved in `path` into the PEFT model; returns the adapter keys the model lacks."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    model = unwrap(model, keep_peft=True)
    if not os.path.exists(os.path.join(path, "adapter_config.json")):
        raise FileNotFoundError(
            f"{path} holds no LoRA adapter (adapter_config.json), but the model is a PEFT "
            "model: resume with the model the run was started with."
        )
    result = set_peft_model_state_dict(model, load_peft_weights(path, device="cpu"))
    return list(result.unexpected_keys)  # type: ignore[attr-defined]  # peft annotates it as "namedtuple"


def lora_config(**kwargs: Any) -> Any:
    """A peft LoraConfig (for `grpo train`'s use_peft and lora_* arguments)."""
    from peft import LoraConfig

    return LoraConfig(**kwargs)
