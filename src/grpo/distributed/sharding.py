"""Sharded models (FSDP2 `fully_shard`, FSDP1, DeepSpeed ZeRO-3): telling them apart, gathering their parameters
for code that reads weights directly, and their checkpoints (torch.distributed.checkpoint shards)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from grpo.distributed import zero


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP (2 or 1) shards this model's parameters."""
    return any(isinstance(m, (FSDPModule, FSDP1)) for m in model.modules())


@contextlib.contextmanager
def full_parameters(model: torch.nn.Module):
    """Every parameter of a sharded model whole, for code that reads weights directly (the lean decoder), then
    sharded again. FSDP2 (`fully_shard`, accelerate's fsdp_version 2): each sharded module is unsharded, its
    parameters plain tensors again; FSDP1: `summon_full_params` without writeback; DeepSpeed ZeRO-3: its
    parameters gathered read-only. Unsharded models: nothing."""
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


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A sharded model's whole state dict, gathered to CPU (every process must call it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Every process writes its shards of the model and optimizer state (torch.distributed.checkpoint)."""
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer)
    dcp.save({"model": model_state_dict, "optimizer": optimizer_state_dict}, checkpoint_id=directory)


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """`save_shards`'s shards back into a model sharded the same way, and its optimizer (every process)."""
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer)
    state = {"model": model_state_dict, "optimizer": optimizer_state_dict}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
