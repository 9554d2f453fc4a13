"""Checkpoints that resume exactly: `<output_dir>/checkpoint-<step>`.

A checkpoint is written under a temporary name and renamed into place once complete, so a crash (or SIGKILL)
mid-write never leaves a directory a resume would pick. It holds:
- the policy and tokenizer as a Hugging Face model directory (loadable with `from_pretrained`);
- `optimizer.pt`, `scheduler.pt` (and `scaler.pt` with fp16 loss scaling); for a sharded model (FSDP) the
  model and optimizer shards instead go to `sharded/`, written by every process with
  torch.distributed.checkpoint; under DeepSpeed, its own engine checkpoint goes to `deepspeed/` (every process
  writes its optimizer partition); the model directory is always whole;
- `rng_state_<rank>.pth` per process (python, numpy, torch CPU and CUDA generators);
- `rollouts_<rank>.pt` per process when the step falls inside a generation cycle (steps_per_generation or
  num_iterations > 1): the buffered batches the next steps train on;
- `trainer_state.json`: step, micro-step, data position, tokens seen, log history, the metrics of an unfinished
  logging window, the world size, the dataset size and the config.

`load` restores all of it, after checking that the checkpoint fits the model and the run (same parameter names
and shapes, same batch geometry, seed, world size and dataset size): what differs is named in the error.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any

import numpy as np
import torch

from grpo import lora
from grpo.distributed import sharding, zero

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STATE = "trainer_state.json"
SCALER = "scaler.pt"  # fp16 loss scaling's state
SHARDED = "sharded"  # torch.distributed.checkpoint directory: a sharded model's and optimizer's shards
# settings that decide which prompts, completions and batches each step sees: a resume must keep them
RUN_GEOMETRY = (
    "seed",
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "generation_batch_size",
    "steps_per_generation",
    "num_iterations",
    "shuffle_dataset",
)


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit this model or run; the message names what differs."""


def model_state(trainer: Any) -> dict[str, torch.Tensor]:
    """The policy's whole state dict on the main process. Every process must call it: for a sharded model it
    gathers the shards (to CPU)."""
    if sharding.is_sharded(trainer.model):
        return sharding.full_state_dict(trainer.model)
    module = trainer.accelerator.unwrap_model(trainer.model)
    if zero.is_partitioned(module):  # whatever stage3_gather_16bit_weights_on_model_save says
        return zero.full_state_dict(module, trainer.accelerator.is_main_process)
    return trainer.accelerator.get_state_dict(trainer.model)


def save_pretrained(trainer: Any, output_dir: str, state_dict: dict[str, torch.Tensor]) -> None:
    """The policy (or its adapter) and tokenizer as a Hugging Face model directory (main process only), from
    `model_state`."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
    trainer.processing_class.save_pretrained(output_dir)


def save(trainer: Any, step: int) -> str:
    root = trainer.args.output_dir
    final = os.path.join(root, f"checkpoint-{step}")
    tmp = os.path.join(root, f".tmp-checkpoint-{step}")
    acc = trainer.accelerator
    acc.wait_for_everyone()
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    acc.wait_for_everyone()
    rank = acc.process_index
    torch.save(_rng_state(), os.path.join(tmp, f"rng_state_{rank}.pth"))
    state_dict = model_state(trainer)
    sharded = sharding.is_sharded(trainer.model)
    deepspeed = zero.in_use(acc)
    if sharded:
        sharding.save_shards(trainer.model, trainer.optimizer, os.path.join(tmp, SHARDED))
    elif deepspeed:  # DeepSpeed's own engine checkpoint: every process writes its optimizer partition
        zero.save(acc, os.path.join(tmp, zero.STATE_DIR))
    if trainer.buffer.mid_cycle(trainer.loop.micro_step):
        torch.save(trainer.buffer.state_dict(), os.path.join(tmp, f"rollouts_{rank}.pt"))
    acc.wait_for_everyone()
    if acc.is_main_process:
        save_pretrained(trainer, tmp, state_dict)
        if not sharded and not deepspeed:
            torch.save(trainer.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
        if acc.scaler is not None:  # fp16 loss scaling: the current scale and its growth tracker
            torch.save(acc.scaler.state_dict(), os.path.join(tmp, SCALER))
        state = {
            "global_step": step,
            **trainer.loop.state_dict(),
            "max_steps": trainer.max_steps,
            "num_input_tokens_seen": trainer.state.num_input_tokens_seen,
            "log_history": trainer.state.log_history,
            "metrics_window": trainer.metrics.state_dict(),
            "num_processes": acc.num_processes,
            "dataset_size": len(trainer.train_dataset),
            "config": {k: v for k, v in trainer.args.to_dict().items() if _jsonable(v)},
        }
        with open(os.path.join(tmp, STATE), "w") as f:
            json.dump(state, f, indent=1)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)  # the checkpoint exists only once it is complete
        _rotate(root, trainer.args.save_total_limit)
    acc.wait_for_everyone()
    return final


def checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [
        (int(m.group(1)), os.path.join(root, name))
        for name in os.listdir(root)
        if (m := CHECKPOINT.match(name)) and os.path.exists(os.path.join(root, name, STATE))
    ]
    return sorted(found)


def resolve(resume_from_checkpoint: str | bool, output_dir: str) -> str:
    """The checkpoint directory to resume from: the newest complete one under output_dir for True."""
    if resume_from_checkpoint is True:
        found = checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(
                f"resume_from_checkpoint=True, but {output_dir!r} holds no complete checkpoint "
                "(checkpoint-<step> with trainer_state.json). Train without resuming, or pass "
                "the path of a checkpoint."
            )
        return found[-1][1]
    path = str(resume_from_checkpoint)
    if not os.path.exists(os.path.join(path, STATE)):
        raise FileNotFoundError(
            f"{path!r} is not a complete grpo checkpoint (no {STATE}); pass a checkpoint-<step> "
            "directory, or resume_from_checkpoint=True for the newest one in output_dir."
        )
    return path


def load(trainer: Any, path: str) -> None:
    """Restore everything `save` wrote into this trainer (every process)."""
    with open(os.path.join(path, STATE)) as f:
        state = json.load(f)
    acc = trainer.accelerator
    # where saved tensors go: accelerate numbers CPU processes' devices ("cpu:1"), which torch.load rejects
    device = "cpu" if acc.device.type == "cpu" else acc.device
    _check_run(trainer, state, path)
    model = acc.unwrap_model(trainer.model)
    sharded, deepspeed = sharding.is_sharded(trainer.model), zero.in_use(acc)
    if sharded:  # the shards hold the whole trainable state, adapters included, and the optimizer's
        sharding.load_shards(trainer.model, trainer.optimizer, os.path.join(path, SHARDED))
    elif deepspeed:  # DeepSpeed's engine checkpoint: the module, and this process's optimizer partition
        try:
            zero.load(acc, os.path.join(path, zero.STATE_DIR))
        except (RuntimeError, FileNotFoundError) as err:
            raise CheckpointMismatchError(
                f"The DeepSpeed state in {path} does not match this run: {str(err).splitlines()[0][:300]}"
            ) from None
    elif lora.is_peft_model(model):
        try:
            unexpected = lora.load_adapter(model, path)
        except RuntimeError as err:  # a shape mismatch
            raise CheckpointMismatchError(
                f"The adapter at {path} does not match the model: {str(err).splitlines()[0][:300]}"
            ) from None
        if unexpected:
            raise CheckpointMismatchError(
                f"The adapter at {path} does not match the model: it has "
                f"{', '.join(unexpected[:3])}, which the model lacks."
            )
    else:
        _load_weights(model, path)
    if not sharded and not deepspeed:
        trainer.optimizer.load_state_dict(
            torch.load(os.path.join(path, "optimizer.pt"), map_location=device, weights_only=True)
        )
    trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=True))
    if acc.scaler is not None and os.path.exists(os.path.join(path, SCALER)):
        acc.scaler.load_state_dict(torch.load(os.path.join(path, SCALER), weights_only=True))
    trainer.state.global_step = state["global_step"]
    trainer.state.num_input_tokens_seen = state["num_input_tokens_seen"]
    trainer.state.log_history = state["log_history"]
    trainer.state.epoch = state["global_step"] / trainer.steps_per_epoch
    trainer.loop.load_state_dict(state)
    trainer.metrics.load_state_dict(state["metrics_window"])
    rank = acc.process_index
    rollouts = os.path.join(path, f"rollouts_{rank}.pt")
    saved = torch.load(rollouts, map_location=device, weights_only=True) if os.path.exists(rollouts) else []
    for batch in saved:  # written by grpo 0.1.0 before the rollout interface: the token count was run state
        if "truncated" in batch:
            del batch["truncated"]
            batch["num_items_in_batch"] = state["num_items"]
    trainer.buffer.load_state_dict(saved, device)
    # python and numpy generator states are plain tuples/arrays; the file is this run's own
    _set_rng_state(torch.load(os.path.join(path, f"rng_state_{rank}.pth"), weights_only=False))


def _check_run(trainer: Any, state: dict[str, Any], path: str) -> None:
    config, args = state["config"], trainer.args.to_dict()
    differ = [
        f"{k}: checkpoint {config.get(k)!r}, now {args.get(k)!r}" for k in RUN_GEOMETRY if config.get(k) != args.get(k)
    ]
    if state["num_processes"] != trainer.accelerator.num_processes:
        differ.append(
            f"number of processes: checkpoint {state['num_processes']}, now {trainer.accelerator.num_processes}"
        )
    if state["dataset_size"] != len(trainer.train_dataset):
        differ.append(f"train_dataset rows: checkpoint {state['dataset_size']}, now {len(trainer.train_dataset)}")
    if differ:
        raise CheckpointMismatchError(
            f"Cannot resume exactly from {path}: " + "; ".join(differ) + ". Resume with "
            "the run's original settings, or start a new run (another output_dir)."
        )


def _load_weights(model: torch.nn.Module, path: str) -> None:
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [name for name in os.listdir(path) if name.endswith(".safetensors")]
    saved: dict[str, torch.Tensor] = {}
    for name in files:
        saved.update(load_file(os.path.join(path, name)))
    own = model.state_dict()
    # save_pretrained writes a tied tensor once: a key missing from the file is fine if it shares storage
    present = {t.data_ptr() for k, t in own.items() if k in saved}
    missing = [k for k in own if k not in saved and own[k].data_ptr() not in present]
    unexpected = [k for k in saved if k not in own]
    shapes = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(own[k].shape)}"
        for k in saved
        if k in own and saved[k].shape != own[k].shape
    ]
    if missing or unexpected or shapes:
        parts = [
            f"{label}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
            for label, items in (
                ("missing from the checkpoint", missing),
                ("not in the model", unexpected),
                ("shape (checkpoint vs model)", shapes),
            )
            if items
        ]
        raise CheckpointMismatchError(
            f"The checkpoint at {path} does not match the model: "
            + "; ".join(parts)
            + ". Resume with the model the run was started with."
        )
    with torch.no_grad():
        for k, tensor in saved.items():
            own[k].copy_(tensor)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rotate(root: str, limit: int | None) -> None:
    if not limit:
        return
    for _, path in checkpoints(root)[:-limit]:
        shutil.rmtree(path, ignore_errors=True)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
