"""Sharded models (FSDP2 `fully_shard`, FSDP1, DeepSpeed ZeRO-3): telling them apart, gathering their parameters
for code that reads weights directly, and their checkpoints (torch.distributed.checkpoint shards)."""

from __future__ import annotations

import contextlib
import pickle
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
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
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)  # full_state_dict: every entry gathered to a whole CPU tensor


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Every process writes its shards of the model and optimizer state (torch.distributed.checkpoint)."""
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer)
    dcp.save({"model": model_state_dict, "optimizer": optimizer_state_dict}, checkpoint_id=directory)


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """`save_shards`'s shards back into a model sharded the same way, and its optimizer (every process). The
    checkpoint's metadata (a pickle) is read with an unpickler that builds only checkpoint-metadata classes."""
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state_dict, "optimizer": optimizer_state_dict}
    dcp.load(state, storage_reader=_MetadataOnlyReader(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds torch.distributed.checkpoint's metadata classes, torch sizes and dtypes and plain containers;
    anything else in the file (a crafted `__reduce__`) is refused instead of run."""

    def find_class(self, module: str, name: str) -> Any:
        plain = {
            ("collections", "OrderedDict"),
            ("builtins", "set"),
            ("builtins", "frozenset"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"),
        }
        if (
            module.startswith("torch.distributed.checkpoint.")
            or (module, name) in plain
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class _MetadataOnlyReader(FileSystemReader):
    """torch's file-system reader, with the metadata read by `_RestrictedUnpickler` (torch's own uses pickle.load)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            metadata = _RestrictedUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
