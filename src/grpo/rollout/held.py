"""The weights a fixed-shape decode step reads (`grpo.rollout.graphed`), at addresses that last the whole run.

A CUDA graph replays the addresses it was captured on. For the graphs of one rollout to be replayed in the next,
every tensor the step reads must still be where it was, holding the policy's weights of now. `HeldWeights` gives the
lean decoder such a tensor for each weight, by name:
- the model's own parameter, where the step reads it as it is (the dtype it computes in, one part): the optimizer
  updates it in place, so the next rollout reads the new numbers at the same address, and nothing is copied;
- else (a cast, q/k/v or gate/up stacked, a LoRA layer's merged copy, a table made from several weights) a tensor of
  its own, made once and refreshed in place (`copy_`, each part cast as it is copied) at every rollout after;
- a parameter that moved (an asynchronous run's snapshot takes each publication's tensors; a sharded model is
  gathered anew for each rollout) gets a tensor of its own from then on.
`version` changes whenever one of the addresses did: graphs captured before it are stale, and are dropped.
"""

from __future__ import annotations

import torch


class HeldWeights:
    """The fixed-shape step's weights for the run (see the module's docstring)."""

    def __init__(self) -> None:
        self.kept: dict[str, tuple[torch.Tensor, bool]] = {}  # name -> (tensor, whether it is our own copy)
        self.version = 0

    def take(self, name: str, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """`parts` stacked by rows in `dtype`, at the address `name` had in the rollouts before where it can be."""
        as_is = len(parts) == 1 and isinstance(parts[0], torch.nn.Parameter) and parts[0].dtype == dtype
        kept = self.kept.get(name)
        if kept is not None:
            tensor, own = kept
            if not own and as_is and _same_memory(tensor, parts[0]):
                return tensor  # the parameter itself, updated in place since
            if own and _fits(tensor, parts, dtype):
                start = 0
                with torch.no_grad():
                    for part in parts:
                        tensor[start : start + len(part)].copy_(part)
                        start += len(part)
                return tensor
            self.version += 1  # a parameter moved, or the weight changed shape
        if as_is and kept is None:
            tensor, own = parts[0].detach(), False
        else:
            tensor, own = cast_stacked(parts, dtype, copy=True), True
        self.kept[name] = (tensor, own)
        return tensor

    def watch(self, name: str, tensor: torch.Tensor) -> None:
        """A tensor the step reads through a module of the model (its rotary embedding's frequencies), which cannot
        be given another: a move changes `version`."""
        kept = self.kept.get(name)
        if kept is None or not _same_memory(kept[0], tensor):
            if kept is not None:
                self.version += 1
            self.kept[name] = (tensor, False)


def cast_stacked(parts: list[torch.Tensor], dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
    """The parts stacked by rows in `dtype`, each cast first: a bfloat16 rollout never holds a float32 copy of a
    weight (one part: itself cast, a copy of its own with `copy`)."""
    if len(parts) == 1:
        return parts[0].detach().to(dtype, copy=copy)
    return torch.cat([w.detach().to(dtype) for w in parts])


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _fits(tensor: torch.Tensor, parts: list[torch.Tensor], dtype: torch.dtype) -> bool:
    rows = sum(len(p) for p in parts)
    return (
        tensor.dtype == dtype
        and tensor.device == parts[0].device
        and tensor.shape == (rows, *parts[0].shape[1:])
        and all(p.shape[1:] == parts[0].shape[1:] for p in parts)
    )
