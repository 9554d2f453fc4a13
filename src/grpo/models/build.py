"""The trainer's models, built and placed: the policy and its tokenizer, the frozen reference, and accelerate's
wrapping of them (DDP, FSDP, DeepSpeed)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from transformers import AutoConfig

from grpo.config import ResolvedConfig
from grpo.distributed import zero
from grpo.models import fp32_head, lora, vision
from grpo.models.modeling import (
    active_dropout,
    disable_dropout,
    enable_checkpointing,
    from_pretrained_checked,
    is_vision_language,
    load_causal_lm,
    load_processing_class,
    prepare_tokenizer,
    reference_model,
    set_use_cache,
)


@dataclass
class Models:
    model: Any
    processing_class: Any  # as given or loaded: the tokenizer, or a vision-language model's processor
    tokenizer: Any  # the text tokenizer (the processor's own, for a processor)
    ref_model: Any  # None when beta == 0 or the reference is the policy without its adapters
    ref_from_adapters: bool

    @property
    def processor(self) -> Any:
        """The multimodal processor (image prompts), None for a tokenizer."""
        return self.processing_class if vision.is_processor(self.processing_class) else None


def default_unused_parameters(args: ResolvedConfig, model: Any) -> None:
    """A vision-language model's text-only rows leave its vision tower without gradients, so DDP looks for unused
    parameters by default (as TRL 1.16; not with reentrant checkpointing, which fails with it)."""
    if args.ddp_find_unused_parameters is not None or (args.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
        return
    if isinstance(model, str):
        try:
            config = from_pretrained_checked(AutoConfig, "model", model, trust_remote_code=args.trust_remote_code)
        except OSError:  # loading the model reports it
            return
    else:
        config = getattr(model, "config", None)
    if is_vision_language(config):
        args.ddp_find_unused_parameters = True


def build(
    model: Any, processing_class: Any, peft_config: Any, args: ResolvedConfig, fsdp_plugin: Any, device: Any
) -> Models:
    """The policy and its tokenizer, loaded for a run on `device`; the frozen reference when beta > 0 (with LoRA:
    the policy with its adapters disabled, no copy; beta == 0: never loaded, shared spec §1.2); checkpointing and
    LoRA."""
    a = args
    model_id = model if isinstance(model, str) else None
    policy = load_causal_lm(model, a.model_init_kwargs, a.trust_remote_code, device) if model_id else model
    source = model_id or getattr(policy.config, "_name_or_path", None)
    if processing_class is None:
        if source is None:
            raise ValueError(
                "The model's config names no checkpoint (`_name_or_path`) to load its tokenizer from: pass "
                "processing_class=."
            )
        processing_class = load_processing_class(source, policy.config, a.trust_remote_code)
    tokenizer = prepare_tokenizer(processing_class)
    from_adapters = a.beta != 0.0 and (peft_config is not None or lora.is_peft_model(policy))
    ref = None
    if a.beta != 0.0 and not from_adapters:
        ref = reference_model(policy, model_id, a.model_init_kwargs, a.trust_remote_code, device)
    enable_checkpointing(policy, a, fsdp_plugin)
    set_use_cache([policy, ref], a.use_cache)
    if peft_config is not None:
        policy = lora.wrap(policy, peft_config, a.gradient_checkpointing, vision.lora_target_modules(policy))
    if a.disable_dropout:  # after the adapters, whose lora_dropout it sets to 0 too (as TRL's order does)
        disable_dropout(policy)
    dropout = active_dropout(policy)
    if dropout:
        warnings.warn(
            "The policy trains with dropout ("
            + ", ".join(f"{kind}={p}" for kind, p in sorted(dropout.items()))
            + "): the training pass's log-probs are then not the ones it sampled with (the sampling/* metrics show "
            "the gap) and the clipped ratio carries dropout's noise. disable_dropout=True turns it off.",
            stacklevel=3,
        )
    fp32_head.apply(a, policy, ref)  # cast_lm_head_to_fp32
    return Models(policy, processing_class, tokenizer, ref, from_adapters)


def _drop_autocast_wrapper(model: Any) -> None:
    """Give the model back the forward it had before accelerate wrapped it in autocast. Not accelerate's
    unwrap_model(keep_fp32_wrapper=False): it peels every `__wrapped__` layer, transformers' own forward decorators
    too (Gemma3's and LLaVA-NeXT's `can_return_tuple`), after which generate fails with "got multiple values for
    keyword argument 'return_dict'"."""
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    if getattr(original, "__func__", None) is type(model).forward:
        model.__dict__.pop("forward", None)  # the class's own forward again
    else:
        model.forward = original


def prepare(
    accelerator: Any, args: ResolvedConfig, model: Any, optimizer: Any, ref_model: Any
) -> tuple[Any, Any, Any, Any]:
    """accelerate's placement and wrapping of the policy, its optimizer and the reference; with async_generation
    also, when FSDP or DeepSpeed is to wrap it, a whole copy of the policy made before they shard it (the async
    producer's snapshot, frozen; else None: `grpo.rounds.asynchronous` copies the prepared policy).
    The schedule is not handed to accelerate: its wrapper steps it once per process per step (it assumes a
    dataloader split across processes), which would end an N-process run's schedule N times early."""
    sharding = getattr(accelerator.state, "fsdp_plugin", None) is not None or zero.in_use(accelerator)
    snapshot = zero.whole_copy(model).eval().requires_grad_(False) if args.async_generation and sharding else None
    zero.configure(accelerator, args)  # DeepSpeed: its "auto" batch values from this config
    model, optimizer = accelerator.prepare(model, optimizer)
    # Precision is set explicitly around each forward (accelerator.autocast()); drop accelerate's autocast wrapper on
    # forward so that code calling the model outside those regions (evaluation) gets float32.
    _drop_autocast_wrapper(accelerator.unwrap_model(model))
    if ref_model is not None:
        ref_model = zero.prepare_reference(accelerator, ref_model) or accelerator.prepare_model(
            ref_model, evaluation_mode=True
        )
    return model, optimizer, ref_model, snapshot.to(accelerator.device) if snapshot is not None else None
