"""Gradient accumulation on one or many processes: one context for a micro-step's backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator

from grpo.distributed import zero


@contextlib.contextmanager
def accumulating(accelerator: Accelerator, model: Any, last: bool) -> Iterator[None]:
    """Around a micro-step: gradients accumulate locally until the `last` micro-step of the optimizer step (DDP's
    all-reduce skipped before it; DeepSpeed told where its accumulation boundary is, so it reduces, clips and steps
    only then)."""
    no_sync = contextlib.nullcontext() if last else accelerator.no_sync(model)
    with no_sync, zero.boundary(accelerator, last):
        yield


def backward(accelerator: Accelerator, loss: torch.Tensor) -> None:
    """`loss.backward()` through accelerate (fp16 loss scaling, DeepSpeed); the loss is already scaled for
    accumulation (`grpo.algo.losses.LossScale`)."""
    accelerator.backward(loss, **zero.backward_kwargs(accelerator))
