"""A config's DDP and process-group settings as accelerate's kwargs handlers, mapped as the HF Trainer maps them:
`ddp_find_unused_parameters`, `ddp_bucket_cap_mb`, `ddp_broadcast_buffers` and `ddp_static_graph` go to the
`DistributedDataParallel` wrapper, `ddp_backend` and `ddp_timeout` to `init_process_group`.

They act where accelerate uses them: the DDP settings when it wraps the policy in DDP (several processes without
FSDP or DeepSpeed), the process-group ones when it starts the process group (several processes)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, KwargsHandler

from grpo.config import ResolvedConfig

# GRPOConfig field -> DistributedDataParallel argument
DDP_FIELDS = {
    "ddp_find_unused_parameters": "find_unused_parameters",
    "ddp_bucket_cap_mb": "bucket_cap_mb",
    "ddp_broadcast_buffers": "broadcast_buffers",
    "ddp_static_graph": "static_graph",
}


def kwargs_handlers(args: ResolvedConfig, cpu_deepspeed: bool = False) -> list[KwargsHandler]:
    """The handlers for `Accelerator(kwargs_handlers=...)`. A DDP field left at None keeps DDP's own default
    (`find_unused_parameters=False`: grpo's loss reaches every trainable parameter). The timeout is always
    passed (1800 s unless set, as the HF Trainer does; torch's own default for NCCL is 600 s). `cpu_deepspeed`:
    DeepSpeed on CPUs, where accelerate must be told gloo unless `ddp_backend` names another backend."""
    ddp = {arg: getattr(args, field) for field, arg in DDP_FIELDS.items() if getattr(args, field) is not None}
    handlers: list[KwargsHandler] = [DistributedDataParallelKwargs(**ddp)] if ddp else []
    group: dict[str, Any] = {"timeout": timedelta(seconds=args.ddp_timeout)}
    backend = args.ddp_backend or ("gloo" if cpu_deepspeed else None)
    if backend is not None:  # None: accelerate picks the device's backend (nccl on CUDA, gloo on CPU)
        group["backend"] = backend
    handlers.append(InitProcessGroupKwargs(**group))
    return handlers
