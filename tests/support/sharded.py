"""accelerate's sharded paths on the CPU, for the job scripts: what `accelerate launch` sets for FSDP2 (with the one
gate lifted that keeps FSDP off the CPU) and for DeepSpeed ZeRO, and every parameter gathered whole."""

from __future__ import annotations

import os


def use_fsdp() -> None:
    """What `accelerate launch` with an FSDP2 config sets (ACCELERATE_USE_FSDP, FSDP_VERSION=2), and one gate lifted:
    accelerate's AcceleratorState takes an FSDP plugin on accelerators only; on CPU, take it as well."""
    import accelerate.state as state

    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")

    original = state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == state.DistributedType.MULTI_CPU:
            self.distributed_type = state.DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    state.AcceleratorState.__init__ = init


def use_deepspeed(stage: int | str) -> None:
    """What `accelerate launch --use_deepspeed --zero_stage N` sets, less one of DeepSpeed's CPU kernels: its
    shared-memory all-reduce, which DeepSpeed would compile from C++ at the first launch on a machine (about 25 s
    on 2 cores). That kernel serves DeepSpeed's inference all-reduce only (ZeRO training reduces through
    torch.distributed, gloo here as NCCL on a GPU) and has no GPU counterpart, so nothing the tests check uses it."""
    import deepspeed.ops

    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE=str(stage))
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def whole(model):
    """Every parameter, gathered whole when sharded (a collective: every process calls it)."""
    from torch.distributed.tensor import DTensor

    from grpo.distributed import zero

    if zero.is_partitioned(model):
        with zero.gathered(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
