"""TR-DPO's moving reference (`sync_ref_model`, arXiv:2404.09656; TRL 1.16's SyncRefModelCallback): after every
`ref_model_sync_steps`-th optimizer step, every parameter of the reference becomes
`alpha * policy + (1 - alpha) * reference` (`ref_model_mixup_alpha`); buffers are left alone.

- DeepSpeed ZeRO-3 partitions both models: their parameters are gathered for the mix (the policy's read-only,
  the reference's written back from process 0, as TRL does).
- With LoRA the reference is the policy with its adapters disabled, not a model of its own: refused
  (NotImplementedError, as TRL). An FSDP-sharded reference is refused too: its checkpoint would need a
  gathering grpo does not implement, and a resumed run would silently start again from the initial reference.
- The mixed reference is part of the run's state: checkpoints hold it (`reference/model.safetensors`, its
  parameters by name) and resuming restores it, so a resumed run continues with the same reference.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from grpo.checkpoint import files
from grpo.config import ResolvedConfig
from grpo.distributed import sharding, zero
from grpo.models.modeling import unwrap

REFERENCE = os.path.join("reference", "model.safetensors")


def check(args: ResolvedConfig, ref_model: torch.nn.Module | None, ref_from_adapters: bool) -> None:
    """Refuse sync_ref_model where there is no reference model of its own to mix into (after `prepare`;
    `ref_from_adapters`: the reference is the policy with its adapters disabled, LoRA)."""
    if not args.sync_ref_model:
        return
    if ref_from_adapters:
        raise NotImplementedError(
            "GRPOConfig.sync_ref_model=True is not supported with a PEFT (LoRA) model: the reference is the policy "
            "with its adapters disabled, so there is no separate reference model to mix the policy into. Set "
            "sync_ref_model=False, or train without peft_config to get a reference model of its own."
        )
    assert ref_model is not None  # beta > 0 (GRPOConfig refuses sync_ref_model with beta=0), no adapters
    if sharding.is_sharded(ref_model):
        raise NotImplementedError(
            "GRPOConfig.sync_ref_model=True is not supported under FSDP: the mixed reference could not be saved in "
            "checkpoints, so a resumed run would silently use the initial one. Use DDP or DeepSpeed ZeRO-3, or "
            "set sync_ref_model=False."
        )


def mix(policy: torch.nn.Module, reference: torch.nn.Module, alpha: float) -> None:
    """reference <- alpha * policy + (1 - alpha) * reference, parameter by parameter (same names, same order)."""
    pairs = list(zip(policy.named_parameters(), reference.named_parameters(), strict=True))
    with torch.no_grad():
        for (name, theta), (ref_name, ref) in pairs:
            if name != ref_name or theta.shape != ref.shape:
                raise ValueError(f"sync_ref_model: the reference's {ref_name} does not match the policy's {name}")
            ref.mul_(1.0 - alpha).add_(theta.to(ref.dtype), alpha=alpha)


def after_step(a: ResolvedConfig, model: torch.nn.Module, ref_model: torch.nn.Module | None, step: int) -> bool:
    """At the end of optimizer step `step`: mix the policy (`model`, as prepared) into the reference when the step is
    a sync step (every process calls it). Returns whether it did."""
    if not a.sync_ref_model or ref_model is None or step % a.ref_model_sync_steps:
        return False
    policy, reference = unwrap(model), unwrap(ref_model)
    with _whole(policy), _whole(reference, modifier_rank=0):
        mix(policy, reference, a.ref_model_mixup_alpha)
    return True


@contextlib.contextmanager
def _whole(model: torch.nn.Module, modifier_rank: int | None = None):
    """ZeRO-3: the parameters gathered (written back from `modifier_rank` when given); otherwise nothing."""
    if zero.is_partitioned(model):
        with zero.gathered(model, modifier_rank=modifier_rank):
            yield
    else:
        yield


class MixedReference:
    """The mixed reference as a state component of checkpoints (`grpo.checkpoint.StateComponent`): saved into each
    checkpoint, read (and checked) with the rest of it, restored once everything has been read."""

    name = "mixed reference"

    def __init__(self, reference: torch.nn.Module, is_main_process: bool) -> None:
        self.reference = reference
        self.is_main_process = is_main_process

    @classmethod
    def of(cls, args: ResolvedConfig, ref_model: torch.nn.Module | None, accelerator: Any) -> list[MixedReference]:
        """The component when sync_ref_model mixes a reference model of its own, else none."""
        if not args.sync_ref_model or ref_model is None:
            return []
        return [cls(ref_model, accelerator.is_main_process)]

    def save(self, directory: str) -> None:
        """Write the mixed reference into the checkpoint being written (every process calls it; the main writes)."""
        reference = unwrap(self.reference)
        with _whole(reference):
            if self.is_main_process:
                tensors = {n: p.detach().cpu().contiguous() for n, p in reference.named_parameters()}
                os.makedirs(os.path.dirname(os.path.join(directory, REFERENCE)), exist_ok=True)
                save_file(tensors, os.path.join(directory, REFERENCE))

    def read(self, checkpoint: str, state: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """The checkpoint's mixed reference, checked against the reference model (None: nothing to restore, the
        checkpoint's run never mixed its reference)."""
        path = os.path.join(checkpoint, REFERENCE)
        if not os.path.exists(path) and not state.get("config", {}).get("sync_ref_model"):
            return None  # saved by a run without sync_ref_model: its reference still is the initial model
        saved = files.read(path, "reference model weights", load_file)
        with _whole(unwrap(self.reference)):
            own = {n: tuple(p.shape) for n, p in unwrap(self.reference).named_parameters()}
        found = {n: tuple(t.shape) for n, t in saved.items()}
        if found != own:
            raise files.invalid(path, "does not match the reference model's parameters (names or shapes)")
        return saved

    def restore(self, saved: dict[str, torch.Tensor] | None) -> None:
        """`read`'s weights into the reference model (every process calls it)."""
        if saved is None:
            return
        reference = unwrap(self.reference)
        with _whole(reference, modifier_rank=0), torch.no_grad():
            for name, param in reference.named_parameters():
                param.copy_(saved[name].to(param.device, param.dtype))
