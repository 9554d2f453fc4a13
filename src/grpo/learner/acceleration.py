"""The run's accelerator: device, precision (bf16=None resolved to "where bfloat16 is fast"), trackers, TF32 and
the process group's options. Above `grpo.distributed`, which it configures, and the trackers
(`grpo.observe.metrics`)."""

from __future__ import annotations

import os
import warnings

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from grpo.config import ResolvedConfig
from grpo.distributed.handlers import kwargs_handlers
from grpo.models.modeling import fast_bf16_available
from grpo.observe.metrics import check_trackers_installed, start_trackers
from grpo.perf.compilation import set_tf32


def make_accelerator(args: ResolvedConfig) -> Accelerator:
    """CUDA unless use_cpu or none is present; bf16=None resolved to "on where bfloat16 is fast"."""
    cpu = args.use_cpu or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    if args.bf16 is None:
        args.bf16 = fast_bf16_available(device) and not args.fp16
    precision = _precision(args, cpu)
    report_to = args.report_to if args.report_to not in (None, "none", ["none"]) else None
    check_trackers_installed(report_to)
    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision") != precision and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # A second trainer in one process (notebooks, tests) with another precision: accelerate keeps one
        # global state and would refuse; in a single process it is safe to start it afresh.
        AcceleratorState._reset_state()
    # accelerate takes DeepSpeed (set up by `accelerate launch`) only when not told cpu=True; with no
    # accelerator it must be told the CPU's process-group backend, or it would count one process
    deepspeed = _deepspeed(args)
    handlers = kwargs_handlers(args, cpu_deepspeed=deepspeed and cpu)  # ddp_* fields, backend, timeout
    set_tf32(args, device)
    accelerator = Accelerator(
        cpu=cpu and not deepspeed,
        mixed_precision=precision,
        log_with=report_to,
        project_dir=args.output_dir,
        kwargs_handlers=handlers,
    )
    if report_to:
        start_trackers(accelerator, args)  # the run `run_name` in the project `project`
    return accelerator


def _deepspeed(args: ResolvedConfig) -> bool:
    """Whether `accelerate launch` set DeepSpeed up for this run (use_cpu turns it off)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not args.use_cpu


def _precision(args: ResolvedConfig, cpu: bool) -> str:
    """accelerate's mixed_precision. fp16 on a CPU (DeepSpeed aside, which casts itself): accelerate has no
    float16 autocast there, so the training pass would run in float32 while the engine sampled in float16; both
    run in float32 instead, with a warning (as with the HF Trainer, training is float32 there)."""
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    if precision == "fp16" and cpu and not _deepspeed(args):
        warnings.warn(
            "GRPOConfig.fp16=True has no effect on a CPU: float16 mixed precision needs a GPU (accelerate has no "
            "float16 autocast on CPUs), so this run computes in float32. bf16=True computes in bfloat16 on CPUs.",
            stacklevel=3,
        )
        return "no"
    return precision
