"""The update: the default optimizer and learning-rate schedule, gradient clipping, and what a non-finite loss or
gradient norm means for the run."""

from __future__ import annotations

import ast
import inspect
import logging
import math
from typing import Any

import torch
from accelerate import Accelerator
from transformers import Trainer, get_scheduler

from grpo.config import ResolvedConfig
from grpo.distributed import zero

logger = logging.getLogger("grpo")


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient); the message names the step and what to try."""


def default_optimizer(model: torch.nn.Module, args: ResolvedConfig) -> torch.optim.Optimizer:
    """The optimizer `args.optim` names, resolved as the HF Trainer resolves it (`optim_args` included), over the
    trainable parameters, with no weight decay on biases and norms. `adamw_torch_fused` (the default) falls back
    to the per-tensor AdamW (the same update) where the parameters cannot be fused."""
    name = str(args.optim)  # checked by GRPOConfig
    try:
        # typed PreTrainedModel; it reads only the parameters, of any module (GaLore's, Apollo's, LOMO's)
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)  # type: ignore[arg-type]
    except ImportError as e:  # bitsandbytes, torchao, ... not installed
        raise ValueError(f"GRPOConfig.optim={name!r} needs a package that is not installed: {e}") from None
    except ValueError as e:
        raise ValueError(f"GRPOConfig.optim={name!r} / optim_args={args.optim_args!r}: {e}") from None
    kwargs = dict(kwargs)
    kwargs.update(_unconsumed_optim_args(cls, kwargs, args.optim_args))
    params = [p for p in model.parameters() if p.requires_grad]
    if kwargs.get("fused") and not all(p.dtype == torch.float32 and p.device.type in ("cpu", "cuda") for p in params):
        kwargs["fused"] = None  # e.g. bf16 or meta parameters: the per-tensor loop computes the same update
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return cls([g for g in groups if g["params"]], **kwargs)


def _unconsumed_optim_args(cls: type[torch.optim.Optimizer], kwargs: dict, optim_args: str | None) -> dict[str, Any]:
    """`optim_args` keys the HF resolver left unused (it reads only some, per optimizer): passed on when the
    optimizer takes them, an error otherwise, so that no argument the user gave is silently dropped."""
    extra = {}
    accepted = inspect.signature(cls.__init__).parameters
    for item in filter(None, (optim_args or "").replace(" ", "").split(",")):
        key, _, text = item.partition("=")
        if key in kwargs:
            continue
        if key not in accepted:
            raise ValueError(
                f"GRPOConfig.optim_args: {cls.__name__} takes no argument {key!r}; it takes "
                f"{', '.join(n for n in accepted if n not in ('self', 'params'))}."
            )
        try:
            extra[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            extra[key] = text
    return extra


def default_scheduler(optimizer: torch.optim.Optimizer, args: ResolvedConfig, max_steps: int) -> Any:
    """The config's schedule; `warmup_steps` below 1 is a fraction of the steps (transformers 5: ceil(ratio x
    steps))."""
    w = args.warmup_steps
    warmup = math.ceil(w * max_steps) if 0 < w < 1 else int(w)
    return get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=max_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
    )


def clip_gradients(accelerator: Accelerator, model: torch.nn.Module, max_norm: float | None) -> float:
    """The gradients' total norm (before clipping), clipped to max_norm when it is set and > 0. Under DeepSpeed,
    which clipped and stepped inside the last backward, the norm it computed."""
    if zero.in_use(accelerator):
        return zero.grad_norm(accelerator)
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm and max_norm > 0:
        return float(accelerator.clip_grad_norm_(params, max_norm))
    accelerator.unscale_gradients()  # fp16 loss scaling (as clip_grad_norm_ does): the norm of the true gradients
    grads = [p.grad for p in params if p.grad is not None]  # all of them: params were chosen for it
    return float(torch.nn.utils.get_total_norm(grads)) if params else 0.0


class GradientCheck:
    """Each step's gradients clipped and checked: the norm, NaN when fp16 loss scaling overflowed (the scaler skips
    the step and lowers the scale); a non-finite norm is an error otherwise, or after fp16 overflowed on every step
    of 32 in a row."""

    def __init__(self, max_norm: float | None) -> None:
        self.max_norm = max_norm
        self.overflows = 0  # fp16 loss-scale overflows in a row

    def __call__(self, accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, step: int) -> float:
        norm = clip_gradients(accelerator, model, self.max_norm)
        finite = math.isfinite(norm)
        self.overflows = 0 if finite or accelerator.scaler is None else self.overflows + 1
        if 0 < self.overflows < 32:
            logger.info("Step %d: fp16 gradients overflowed; the step is skipped and the loss scale lowered.", step)
            return float("nan")
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            applied = zero.in_use(accelerator)  # DeepSpeed steps inside backward
            raise TrainingError(nonfinite_message(step, "gradient norm", norm, applied))
        return norm


def nonfinite_message(step: int, what: str, value: float, applied: bool) -> str:
    """The error for a non-finite loss or gradient norm at `step`; `applied`: the update was already made."""
    fix = "Try a lower learning_rate, a smaller max_grad_norm, or float32 (bf16=False)."
    if applied:
        return (
            f"Step {step}: the {what} is {value}; DeepSpeed had already applied this step inside backward, so "
            "the model in memory is damaged, but every saved checkpoint is intact: resume from the newest "
            f"(resume_from_checkpoint=True). {fix}"
        )
    return (
        f"Step {step}: the {what} is {value}; training stopped before the optimizer applied it, so the model "
        f"and every saved checkpoint are as they were after the previous step. {fix}"
    )
