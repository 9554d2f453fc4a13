"""The accelerator (device, precision, trackers), the default optimizer and learning-rate schedule, and the
process-level settings a CPU run needs (allocator policy, teardown of the process group)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import math
import os
import platform
import time
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import InitProcessGroupKwargs
from transformers import get_scheduler

from grpo.modeling import base_model, fast_bf16_available

logger = logging.getLogger("grpo")


def make_accelerator(args: Any) -> Accelerator:
    """CUDA unless use_cpu or none is present; bf16=None resolved to "on where bfloat16 is fast"."""
    cpu = args.use_cpu or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    if args.bf16 is None:
        args.bf16 = fast_bf16_available(device) and not args.fp16
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    report_to = args.report_to if args.report_to not in (None, "none", ["none"]) else None
    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision") != precision and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # A second trainer in one process (notebooks, tests) with another precision: accelerate keeps one
        # global state and would refuse; in a single process it is safe to start it afresh.
        AcceleratorState._reset_state()
    # accelerate takes DeepSpeed (set up by `accelerate launch`) only when not told cpu=True; with no
    # accelerator it must be told the CPU's process-group backend, or it would count one process
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not args.use_cpu
    handlers = [InitProcessGroupKwargs(backend="gloo")] if deepspeed and cpu else None
    accelerator = Accelerator(cpu=cpu and not deepspeed, mixed_precision=precision, log_with=report_to,
                              project_dir=args.output_dir, kwargs_handlers=handlers)
    if report_to:
        accelerator.init_trackers(args.run_name or "grpo", config=_trackable(args.to_dict()))
    return accelerator


def default_optimizer(model: torch.nn.Module, args: Any) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, no weight decay on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused: one kernel for all parameters (same update as the per-tensor loop, far fewer passes)
    fused = all(p.dtype == torch.float32 and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.learning_rate,
                             betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, fused=fused or None)


def default_scheduler(optimizer: torch.optim.Optimizer, args: Any, max_steps: int) -> Any:
    warmup = args.warmup_steps or math.ceil(args.warmup_ratio * max_steps)
    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=max_steps,
                         scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})


def enable_checkpointing(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def recomputes_activations(model: torch.nn.Module) -> bool:
    """Whether gradient (activation) checkpointing is on: backward then re-runs the forward."""
    model = base_model(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the first: transformers >= 5.2x
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP (2 or 1) shards this model's parameters."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return any(isinstance(m, (FSDPModule, FSDP1)) for m in model.modules())


@contextlib.contextmanager
def full_parameters(model: torch.nn.Module):
    """Every parameter of a sharded model whole, for code that reads weights directly (the lean decoder), then
    sharded again. FSDP2 (`fully_shard`, accelerate's fsdp_version 2): each sharded module is unsharded, its
    parameters plain tensors again; FSDP1: `summon_full_params` without writeback; DeepSpeed ZeRO-3: its
    parameters gathered read-only. Unsharded models: nothing."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    from grpo import zero

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]  # FSDP2
    if sharded:
        for module in sharded:
            module.unshard()
        try:
            yield
        finally:
            for module in sharded:
                module.reshard()
    elif is_sharded(model):  # FSDP1
        with FSDP1.summon_full_params(model, writeback=False, recurse=True):
            yield
    elif zero.is_partitioned(model):
        with zero.gathered(model):
            yield
    else:
        yield


def clip_gradients(accelerator: Accelerator, model: torch.nn.Module, max_norm: float | None) -> float:
    """The gradients' total norm (before clipping), clipped to max_norm when it is set and > 0. Under DeepSpeed,
    which clipped and stepped inside the last backward, the norm it computed."""
    from grpo import zero

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
        return (f"Step {step}: the {what} is {value}; DeepSpeed had already applied this step inside backward, so "
                "the model in memory is damaged, but every saved checkpoint is intact: resume from the newest "
                f"(resume_from_checkpoint=True). {fix}")
    return (f"Step {step}: the {what} is {value}; training stopped before the optimizer applied it, so the model "
            f"and every saved checkpoint are as they were after the previous step. {fix}")


def any_process(accelerator: Accelerator, flag: bool) -> bool:
    """True on every process when the flag is set on any of them."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), "sum") > 0)


def process_mean(accelerator: Accelerator, value: float) -> float:
    """The mean of a number over processes (the same on every process)."""
    if accelerator.num_processes == 1:
        return value
    return float(accelerator.reduce(torch.tensor(float(value), device=accelerator.device), "mean"))


def end_training(accelerator: Accelerator) -> None:
    """The end of `train()`: trackers finished. The process group stays up, so that calls after training that
    need every process (`save_model` gathers a sharded model) still work; it is torn down at exit, settled."""
    for tracker in accelerator.trackers:
        tracker.finish()
    if accelerator.num_processes > 1 and accelerator not in _TEARDOWN:
        _TEARDOWN.append(accelerator)
        atexit.register(_tear_down, accelerator)


_TEARDOWN: list[Accelerator] = []


def _tear_down(accelerator: Accelerator) -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        settle_processes(accelerator)
        accelerator.state.destroy_process_group()


def settle_processes(accelerator: Accelerator) -> None:
    """Before the process group can be torn down: a barrier, then a moment without the GIL. gloo's worker threads
    need the GIL to drop the work objects of the last collectives, and torch's gloo destructor joins them while
    holding it: torn down too early, a CPU run hung at exit about one time in three."""
    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
        time.sleep(0.2)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def env_flag(name: str) -> bool:
    """A grpo switch in the environment: set and not "0"."""
    return os.environ.get(name, "0") not in ("", "0")


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse instead of handing it back to the kernel (CPU training).

    By default glibc serves every allocation over a few MiB with a fresh mmap and unmaps it on free, so each
    step's logits, activations and gradients are faulted in page by page again: measured here, 300k-670k page
    faults and 1-4 s of kernel time per training pass of the benchmark (about a third of it). With mmap
    disabled and trimming off, large blocks come from the heap and are reused from the second step on (0 faults);
    the peak resident size is the heap's high-water mark, which measured no larger (4.67 vs 4.82 GB). Same
    numbers, only where memory comes from. Set GRPO_SYSTEM_MALLOC=1 to keep the system's policy. Returns whether
    the policy was applied (glibc only)."""
    if env_flag("GRPO_SYSTEM_MALLOC") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    if applied:
        logger.info("CPU allocator: freed memory is kept for reuse (GRPO_SYSTEM_MALLOC=1 to turn off)")
    return applied


def _trackable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in config.items()}
