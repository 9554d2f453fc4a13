"""The trainer's models, built and placed: the policy and its tokenizer, the frozen reference, and accelerate's
wrapping of them (DDP, FSDP, DeepSpeed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo import fp32_head, lora
from grpo.distributed import zero
from grpo.modeling import (
    disable_dropout,
    enable_checkpointing,
    load_causal_lm,
    load_tokenizer,
    prepare_tokenizer,
    reference_model,
    set_use_cache,
)


@dataclass
class Models:
    model: Any
    processing_class: Any
    ref_model: Any  # None when beta == 0 or the reference is the policy without its adapters
    ref_from_adapters: bool


def build(model: Any, processing_class: Any, peft_config: Any, args: Any, fsdp_plugin: Any) -> Models:
    """The policy and its tokenizer; the frozen reference when beta > 0 (with LoRA: the policy with its adapters
    disabled, no copy; beta == 0: never loaded, shared spec §1.2); checkpointing and LoRA."""
    a = args
    model_id = model if isinstance(model, str) else None
    policy = load_causal_lm(model, a.model_init_kwargs, a.trust_remote_code) if model_id else model
    source = model_id or getattr(policy.config, "_name_or_path", None)
    tokenizer = (
        prepare_tokenizer(processing_class)
        if processing_class is not None
        else load_tokenizer(source, a.trust_remote_code)
    )
    if a.disable_dropout:
        disable_dropout(policy)
    from_adapters = a.beta != 0.0 and (peft_config is not None or lora.is_peft_model(policy))
    ref = None
    if a.beta != 0.0 and not from_adapters:
        ref = reference_model(policy, model_id, a.model_init_kwargs, a.trust_remote_code)
    enable_checkpointing(policy, a, fsdp_plugin)
    set_use_cache([policy, ref], a.use_cache)
    if peft_config is not None:
        policy = lora.wrap(policy, peft_config, a.gradient_checkpointing)
    fp32_head.apply(a, policy, ref)  # cast_lm_head_to_fp32
    return Models(policy, tokenizer, ref, from_adapters)


def prepare(accelerator: Any, args: Any, model: Any, optimizer: Any, ref_model: Any) -> tuple[Any, Any, Any]:
    """accelerate's placement and wrapping of the policy, its optimizer and the reference. The schedule is not handed
    to accelerate: its wrapper steps it once per process per step (it assumes a dataloader split across processes),
    which would end an N-process run's schedule N times early."""
    zero.configure(accelerator, args)  # DeepSpeed: its "auto" batch values from this config
    model, optimizer = accelerator.prepare(model, optimizer)
    # Precision is set explicitly around each forward (accelerator.autocast()); drop accelerate's autocast wrapper on
    # forward so that code calling the model outside those regions (evaluation) gets float32.
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    if ref_model is not None:
        ref_model = zero.prepare_reference(accelerator, ref_model) or accelerator.prepare_model(
            ref_model, evaluation_mode=True
        )
    return model, optimizer, ref_model
