"""The update: the default optimizer and learning-rate schedule, gradient clipping, and what a non-finite loss or
gradient norm means for the run."""

from __future__ import annotations

import math
from typing import Any

import torch
from accelerate import Accelerator
from transformers import get_scheduler

from grpo.distributed import zero


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient); the message names the step and what to try."""


def default_optimizer(model: torch.nn.Module, args: Any) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, no weight decay on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # fused: one kernel for all parameters (same update as the per-tensor loop, far fewer passes)
    fused = all(p.dtype == torch.float32 and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=fused or None,
    )


def default_scheduler(optimizer: torch.optim.Optimizer, args: Any, max_steps: int) -> Any:
    warmup = args.warmup_steps or math.ceil(args.warmup_ratio * max_steps)
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
    return float(torch.nn.utils.get_total_norm([p.grad for p in params])) if params else 0.0


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
