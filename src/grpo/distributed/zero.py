"""DeepSpeed ZeRO through accelerate (`accelerate launch --use_deepspeed` or an accelerate config with a
`deepspeed_config`): what the trainer does differently when DeepSpeed owns the model and optimizer.

- The DeepSpeed config's "auto" values come from GRPOConfig (micro-batch, gradient accumulation, clipping);
  an explicit value that differs is an error naming both.
- DeepSpeed accumulates, reduces, clips and steps inside `accelerator.backward` at the accumulation boundary,
  which the trainer marks (`boundary`); the loss is already scaled for accumulation by the trainer
  (`scale_wrt_gas=False`), so the update is the same as the plain path's. The gradient norm is DeepSpeed's.
- ZeRO-3 partitions every parameter: the rollout gathers them for its duration (the same as FSDP), and the
  tiled output head, which reads the head's weight outside its forward, is not used. A reference model (beta > 0
  without LoRA) is partitioned the same way.
- Checkpoints: DeepSpeed's own (`engine.save_checkpoint`, every process writes its partition of the optimizer;
  it holds the module's weights too, beside the checkpoint's whole model directory).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from grpo.config import ResolvedConfig

STATE_DIR = "deepspeed"  # inside a checkpoint: DeepSpeed's engine checkpoint
_TAG = "state"


def plugin(accelerator: Any) -> Any:
    """accelerate's active DeepSpeed plugin, or None when DeepSpeed is not in use."""
    return getattr(accelerator.state, "deepspeed_plugin", None)


def in_use(accelerator: Any) -> bool:
    return plugin(accelerator) is not None


def engine(accelerator: Any) -> Any:
    """The DeepSpeed engine accelerate made in `prepare`."""
    return accelerator.deepspeed_engine_wrapped.engine


def configure(accelerator: Any, args: ResolvedConfig) -> None:
    """Fill the DeepSpeed config's "auto" (or missing) batch, accumulation and clipping values from GRPOConfig,
    before `accelerator.prepare`; explicit values that differ raise a ValueError naming each."""
    ds = plugin(accelerator)
    if ds is None:
        return
    config = ds.deepspeed_config
    mb, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
    wanted = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": ga,
        "train_batch_size": mb * ga * accelerator.num_processes,
        "gradient_clipping": float(args.max_grad_norm or 0.0),
    }
    mismatches = []
    for key, value in wanted.items():
        given = config.get(key, "auto")
        if given == "auto":
            config[key] = value
        elif float(given) != float(value):
            mismatches.append(f"{key} is {given} in the DeepSpeed config and {value} from GRPOConfig")
    if mismatches:
        raise ValueError(
            "The DeepSpeed config disagrees with GRPOConfig: " + "; ".join(mismatches) + ". Set these "
            'to "auto" in the DeepSpeed config (GRPOConfig then decides), or make them equal.'
        )
    ds.gradient_accumulation_steps = ga
    accelerator.gradient_accumulation_steps = ga


def prepare_reference(accelerator: Any, model: torch.nn.Module) -> Any:
    """Under ZeRO-3, the reference model partitioned like the policy (a DeepSpeed engine without optimizer), so
    no process holds it whole; None otherwise (accelerate places it as usual)."""
    ds = plugin(accelerator)
    if ds is None or ds.zero_stage != 3:
        return None
    import deepspeed

    config = copy.deepcopy(ds.deepspeed_config)  # the policy's, its "auto" values filled by then
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    reference, *_ = deepspeed.initialize(model=model, config=config)
    reference.eval()
    return reference


@contextlib.contextmanager
def boundary(accelerator: Any, last: bool):
    """Under DeepSpeed, tell it whether this micro-step's backward ends the accumulation window: accelerate's
    wrapper sets DeepSpeed's boundary from its sync_gradients flag (True unless its own `accumulate` counts) and
    steps the engine then. The HF Trainer sets the flag the same way."""
    if not in_use(accelerator):
        yield
        return
    accelerator.gradient_state._set_sync_gradients(last)
    try:
        yield
    finally:
        accelerator.gradient_state._set_sync_gradients(True)


def backward_kwargs(accelerator: Any) -> dict[str, Any]:
    """Extra arguments for `accelerator.backward`: under DeepSpeed the loss is already scaled for accumulation."""
    return {"scale_wrt_gas": False} if in_use(accelerator) else {}


def grad_norm(accelerator: Any) -> float:
    """The gradient norm DeepSpeed computed (before clipping) when it stepped in the last backward."""
    norm = engine(accelerator).get_global_grad_norm()
    return float(norm) if norm is not None else 0.0


def is_partitioned(model: torch.nn.Module) -> bool:
    """Whether ZeRO-3 partitions this model's parameters."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def whole_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with plain, whole parameters where ZeRO-3 partitions them (their values unset: the
    caller fills them from the gathered model); tied parameters stay tied. Not partitioned: a deep copy."""
    other = copy.deepcopy(model)
    if not is_partitioned(model):
        return other
    whole: dict[int, torch.nn.Parameter] = {}
    for source, module in zip(model.modules(), other.modules()):  # the copy's keep no ds_shape: the source's
        for name, param in list(source._parameters.items()):
            if param is None:
                continue
            if id(param) not in whole:
                value = torch.empty(getattr(param, "ds_shape", param.shape), dtype=param.dtype, device=param.device)
                whole[id(param)] = torch.nn.Parameter(value, requires_grad=param.requires_grad)
            module._parameters[name] = whole[id(param)]
    return other


@contextlib.contextmanager
def gathered(model: torch.nn.Module, modifier_rank: int | None = None):
    """Every ZeRO-3 parameter whole within the context, partitioned again after: read-only, or with
    `modifier_rank`, written back from that process's values."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=modifier_rank):
        yield


def full_state_dict(model: torch.nn.Module, main: bool) -> dict[str, torch.Tensor]:
    """A ZeRO-3 model's whole state dict on the main process, on CPU (every process must call it)."""
    state = {}
    with gathered(model):
        if main:
            state = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    return state


def save(accelerator: Any, directory: str) -> None:
    """Every process writes its part of DeepSpeed's engine state (module, optimizer partitions)."""
    engine(accelerator).save_checkpoint(directory, tag=_TAG)


def load(accelerator: Any, directory: str) -> None:
    """`save`'s state back into the engine (every process); the scheduler is restored by the trainer. DeepSpeed
    reads its files with `torch.load` unrestricted (weights-only off); here they are read weights-only, with the few
    DeepSpeed and Python classes its checkpoints hold allowed by name, so a crafted file cannot run code."""
    with _weights_only_torch_load():
        path, _ = engine(accelerator).load_checkpoint(
            directory, tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
    if path is None:
        raise FileNotFoundError(f"No DeepSpeed state in {directory}")


def _checkpoint_globals() -> list[Any]:
    """The classes (besides tensors and containers) that DeepSpeed's engine checkpoints hold: the loss scaler's
    state, the ZeRO stage, parameter fragment addresses."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def _weights_only_torch_load():
    """While active, every `torch.load` is weights-only (whatever the caller asks), with `_checkpoint_globals`."""
    original = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(_checkpoint_globals()):
            return original(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original
