"""The accelerator (device, precision, trackers, process group) and the end of a run's process group."""

from __future__ import annotations

import atexit
import os
import time
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import InitProcessGroupKwargs

from grpo.modeling import fast_bf16_available


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
    accelerator = Accelerator(
        cpu=cpu and not deepspeed,
        mixed_precision=precision,
        log_with=report_to,
        project_dir=args.output_dir,
        kwargs_handlers=handlers,
    )
    if report_to:
        accelerator.init_trackers(args.run_name or "grpo", config=_trackable(args.to_dict()))
    return accelerator


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


def _trackable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in config.items()}
