"""Checkpoints that resume exactly: `<output_dir>/checkpoint-<step>`.

A checkpoint is written under a temporary name and renamed into place once complete, so a crash (or SIGKILL)
mid-write never leaves a directory a resume would pick; a failed write (a full disk) removes the temporary
directory and says which complete checkpoint is the newest. It holds:
- the policy and tokenizer as a Hugging Face model directory (loadable with `from_pretrained`);
- `optimizer.pt`, `scheduler.pt` (and `scaler.pt` with fp16 loss scaling); for a sharded model (FSDP) the
  model and optimizer shards instead go to `sharded/`, written by every process with
  torch.distributed.checkpoint; under DeepSpeed, its own engine checkpoint goes to `deepspeed/` (every process
  writes its optimizer partition); the model directory is always whole;
- `rng_state_<rank>.pt` per process (python, numpy, torch CPU and CUDA generators, as tensors and numbers);
- `rollouts_<rank>.pt` per process when the step falls inside a generation cycle (steps_per_generation or
  num_iterations > 1): the buffered batches the next steps train on;
- `trainer_state.json`: step, micro-step, data position, tokens seen, log history, the metrics of an unfinished
  logging window, whether rollouts were buffered, the world size, the dataset size and the config. A checkpoint
  is written before its step's evaluation; the evaluation's row is added to it afterwards (`add_evaluation`).

`load` restores all of it, after checking that every file reads back (weights-only: nothing in a checkpoint can
run code; only regular files, within their sizes: a FIFO, a device or a symlink to one is refused unopened, so
nothing blocks or reads without end), that every JSON file has its shape and trainer_state.json is consistent, and
that the checkpoint fits the model and the run (same parameter names and shapes, same batch geometry, seed, world
size and dataset size): what is wrong is named in the error, with the next-newest complete checkpoint. A checkpoint
saved with save_only_model holds the model directory and trainer_state.json only, and is refused as a starting point
to resume from.

When to save, the best checkpoint (trainer_state.json names it: best_metric, best_global_step,
best_model_checkpoint), rotation (`save_total_limit`: never the newest nor the best) and which processes write
are decided in `strategy`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import SafetensorError

from grpo.checkpoint import files, strategy
from grpo.checkpoint.files import CheckpointError, CheckpointMismatchError, checkpoints
from grpo.checkpoint.run import CheckpointedRun, StateComponent
from grpo.distributed import collectives, sharding, zero
from grpo.models import lora

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointedRun",
    "StateComponent",
    "add_evaluation",
    "checkpoints",
    "load",
    "resolve",
    "save",
]
STATE = files.STATE


SHARDED = "sharded"  # torch.distributed.checkpoint directory: a sharded model's and optimizer's shards


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, say); its temporary directory is gone and the message
    names the newest complete checkpoint."""


def model_state(trainer: CheckpointedRun) -> dict[str, torch.Tensor]:
    """The policy's whole state dict on the main process. Every process must call it: for a sharded model it
    gathers the shards (to CPU)."""
    if sharding.is_sharded(trainer.model):
        return sharding.full_state_dict(trainer.model)
    module = trainer.accelerator.unwrap_model(trainer.model)
    if zero.is_partitioned(module):  # whatever stage3_gather_16bit_weights_on_model_save says
        return zero.full_state_dict(module, trainer.accelerator.is_main_process)
    return trainer.accelerator.get_state_dict(trainer.model)


def save_pretrained(trainer: CheckpointedRun, output_dir: str, state_dict: dict[str, torch.Tensor]) -> None:
    """The policy (or its adapter), tokenizer and model card (the trainer's `write_model_card`) as a Hugging Face
    model directory (main process only), from `model_state`."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
    trainer.processing_class.save_pretrained(output_dir)
    trainer.write_model_card(output_dir)


def save(trainer: CheckpointedRun, step: int) -> str:
    """Write checkpoint-<step> (every process takes part); returns its path."""
    acc, root = trainer.accelerator, trainer.args.output_dir
    final, tmp = os.path.join(root, f"checkpoint-{step}"), os.path.join(root, f".tmp-checkpoint-{step}")
    acc.wait_for_everyone()
    writer = strategy.writer(trainer)  # the main process, or each node's with save_on_each_node
    strategy.record_best(trainer, step, final)  # before trainer_state.json is written: it names the best
    _phase(trainer, step, tmp, lambda: _fresh_directory(tmp) if writer else None)
    state_dict = model_state(trainer)  # a collective for sharded models
    _phase(trainer, step, tmp, lambda: _write_process_files(trainer, tmp))
    _phase(trainer, step, tmp, lambda: _write_main_files(trainer, step, tmp, final, state_dict) if writer else None)
    acc.wait_for_everyone()
    return final


def add_evaluation(trainer: CheckpointedRun, path: str) -> None:
    """After the evaluation of a step whose checkpoint was written before it (`GRPOTrainer._checkpoint`):
    the evaluation's row, the best checkpoint it makes and the callbacks' states after on_evaluate go into the
    checkpoint's trainer_state.json, replaced atomically (a crash meanwhile leaves the complete checkpoint as it
    was); rotation then sees the new best. Every process calls it."""
    step = trainer.state.global_step
    strategy.record_best(trainer, step, path)
    error = _add_to_state(trainer, path) if strategy.writer(trainer) else None
    if collectives.any_process(trainer.accelerator, error is not None):
        detail = f"{type(error).__name__}: {error}" if error else "another process could not write its copy"
        raise CheckpointWriteError(
            f"Could not add the evaluation of step {step} to {os.path.join(path, STATE)} ({detail}); the "
            "checkpoint itself is complete and resumes (without that evaluation's row)."
        ) from error
    if strategy.writer(trainer):
        strategy.rotate(
            trainer.args.output_dir, trainer.args.save_total_limit, path, trainer.state.best_model_checkpoint
        )
    trainer.accelerator.wait_for_everyone()


def _add_to_state(trainer: CheckpointedRun, path: str) -> OSError | None:
    file, tmp = os.path.join(path, STATE), os.path.join(path, STATE + ".tmp")
    try:
        with open(file) as f:
            state = json.load(f)
        state.update(
            log_history=trainer.state.log_history,
            stateful_callbacks=trainer.callback_handler.states(),
            **strategy.best_state(trainer.state),
        )
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, file)
    except OSError as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        return err
    return None


def _fresh_directory(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def _write_process_files(trainer: CheckpointedRun, tmp: str) -> None:
    """What every process writes: its shards, and its state components (its generator states, its buffered
    rollouts, the mixed reference: `components`); none of it with save_only_model."""
    acc = trainer.accelerator
    if trainer.args.save_only_model:
        return
    if sharding.is_sharded(trainer.model):
        sharding.save_shards(trainer.model, trainer.optimizer, os.path.join(tmp, SHARDED))
    elif zero.in_use(acc):  # DeepSpeed's own engine checkpoint: every process writes its optimizer partition
        zero.save(acc, os.path.join(tmp, zero.STATE_DIR))
    for component in trainer.state_components:  # parts of the run that save themselves (StateComponent)
        component.save(tmp)


def _write_main_files(
    trainer: CheckpointedRun, step: int, tmp: str, final: str, state_dict: dict[str, torch.Tensor]
) -> None:
    """What the main process writes: the model directory and trainer_state.json (the components' `fields`, the
    best checkpoint, the callbacks' states); then the rename that makes the checkpoint exist, and the rotation."""
    save_pretrained(trainer, tmp, state_dict)
    state: dict[str, Any] = {"global_step": step}
    for component in trainer.state_components:  # the run's record (components.TrainingRecord)
        state.update(component.fields() if hasattr(component, "fields") else {})
    state.update(
        save_only_model=trainer.args.save_only_model,
        **strategy.best_state(trainer.state),
        stateful_callbacks=trainer.callback_handler.states(),
    )
    with open(os.path.join(tmp, STATE), "w") as f:
        json.dump(state, f, indent=1)
    _replace(tmp, final)  # the checkpoint exists only once it is complete
    strategy.rotate(trainer.args.output_dir, trainer.args.save_total_limit, final, trainer.state.best_model_checkpoint)


def _replace(tmp: str, final: str) -> None:
    """Rename tmp to final; a checkpoint already there (the same step written again) is kept until then."""
    if not os.path.exists(final):
        os.replace(tmp, final)
        return
    old = final + ".replaced"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _phase(trainer: CheckpointedRun, step: int, tmp: str, work: Any) -> None:
    """Run one part of writing a checkpoint (every process calls it); if it fails on any process, every process
    raises a CheckpointWriteError after the temporary directory is removed, so that none waits for the others."""
    error = None
    try:
        work()
    except (OSError, RuntimeError, SafetensorError) as err:  # torch.save reports a full disk as RuntimeError
        error = err  # ("... unexpected pos"), safetensors as SafetensorError ("No space left on device")
    if not collectives.any_process(trainer.accelerator, error is not None):
        return
    if strategy.writer(trainer):
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointWriteError(_write_failure(trainer.args.output_dir, step, error)) from error


def _write_failure(root: str, step: int, error: BaseException | None) -> str:
    found = checkpoints(root)
    newest = f"the last complete checkpoint is {found[-1][1]}" if found else "there is no complete checkpoint yet"
    text = str(error) if error is not None else "another process failed to write its part"
    full = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or any(
        hint in text for hint in ("No space left", "unexpected pos", "file write failed")
    )
    if full:
        return (
            f"No space left on the device while writing checkpoint-{step} in {root}; its temporary directory "
            f"was removed and {newest}. Free some space (or set save_total_limit) and resume from it."
        )
    return (
        f"Could not write checkpoint-{step} in {root} ({type(error).__name__}: {text.splitlines()[0][:200]}); "
        f"its temporary directory was removed and {newest}."
    )


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


def load(trainer: CheckpointedRun, path: str) -> None:
    """Restore everything `save` wrote into this trainer (every process). Nothing is changed in the trainer
    until every file has been read and checked."""
    acc, args = trainer.accelerator, trainer.args
    files.check_files(path)  # only regular files, before any library reads one (a FIFO would block it)
    state = files.read_state(path, trainer.max_steps, args.gradient_accumulation_steps)
    if state.get("save_only_model"):
        raise CheckpointError(
            f"{path} was saved with save_only_model=True: it holds the model only (no optimizer, schedule, random "
            f"generator states or buffered rollouts), so a run cannot resume from it. Start a new run from its "
            f"weights (model={path!r}, without resume_from_checkpoint), or resume from a checkpoint saved with "
            "save_only_model=False."
        )
    # read and checked, not applied (the record first: whether the checkpoint fits this run at all)
    components = [(c, c.read(path, state)) for c in trainer.state_components]
    best = strategy.read_best(state, path)
    if args.restore_callback_states_from_checkpoint:
        saved = state.get("stateful_callbacks") or {}
        files.apply(path, STATE, lambda: trainer.callback_handler.restore(saved))  # a state a callback cannot take
    _load_model(trainer, path, sharding.is_sharded(trainer.model), zero.in_use(acc))
    for name, value in best.items():
        setattr(trainer.state, name, value)
    for component, value in components:  # the record first, the generators last (`components.of_run`)
        component.restore(value)


def load_model_weights(trainer: CheckpointedRun, path: str) -> None:
    """The model weights of checkpoint `path` into the trainer's model (every process), as a resume loads them:
    load_best_model_at_end."""
    files.check_files(path)
    _load_model(trainer, path, sharding.is_sharded(trainer.model), zero.in_use(trainer.accelerator))


def _load_model(trainer: CheckpointedRun, path: str, sharded: bool, deepspeed: bool) -> None:
    acc = trainer.accelerator
    model = acc.unwrap_model(trainer.model)
    if sharded:  # the shards hold the whole trainable state, adapters included, and the optimizer's
        files.read(
            os.path.join(path, SHARDED),
            "sharded model and optimizer state",
            lambda p: sharding.load_shards(trainer.model, trainer.optimizer, p),
        )
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


def _load_weights(model: torch.nn.Module, path: str) -> None:
    own = model.state_dict()
    saved = _as_model_keys(model, files.load_weight_files(path), own)
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


def _as_model_keys(model: torch.nn.Module, saved: dict, own: dict) -> dict:
    """The saved tensors under the model's own names and in its own layout. save_pretrained writes the Hub's:
    transformers reverts the renames and fusions it applies when loading (Qwen2.5-VL's `model.language_model.layers.*`
    is saved as `model.layers.*`, Qwen3-MoE's fused experts as one matrix per expert). Those conversions applied
    forward give the model's: each one reversed, run through transformers' own `revert_weight_conversion` (so each
    transformers release applies its own rules), last first."""
    if all(k in own for k in saved):
        return saved
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
        from transformers.modeling_utils import revert_weight_conversion

        conversions = getattr(model, "_weight_conversions", None)  # those from_pretrained applied
        if conversions is None:  # a model built otherwise: its architecture's, as revert_weight_conversion finds them
            mapping = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
            conversions = [c for c in mapping if not isinstance(c, PrefixChange)]
        if not conversions:
            return saved
        reversed_ = [conversion.reverse_transform() for conversion in conversions][::-1]
        forward = SimpleNamespace(config=model.config, _weight_conversions=reversed_)
        return revert_weight_conversion(forward, dict(saved))  # type: ignore[arg-type]
    except Exception:  # no conversion known (another transformers): the names are compared as they are
        return saved
