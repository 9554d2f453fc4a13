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
are decided in `strategy`. Every function here takes the run's values (`Saved`), never the trainer: it reads the
trainer state and never writes it (`load` returns what the trainer sets, `Resumed`).
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
from grpo.checkpoint.saved import Resumed, Saved, StateComponent
from grpo.distributed import collectives, sharding, zero
from grpo.models import lora

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "Resumed",
    "Saved",
    "StateComponent",
    "add_evaluation",
    "checkpoints",
    "load",
    "path_of",
    "resolve",
    "save",
]
STATE = files.STATE


SHARDED = "sharded"  # torch.distributed.checkpoint directory: a sharded model's and optimizer's shards


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, say); its temporary directory is gone and the message
    names the newest complete checkpoint."""


def model_state(model: torch.nn.Module, accelerator: Any) -> dict[str, torch.Tensor]:
    """The policy's whole state dict on the main process (`model`: as prepared). Every process must call it: for
    a sharded model it gathers the shards (to CPU)."""
    if sharding.is_sharded(model):
        return sharding.full_state_dict(model)
    module = accelerator.unwrap_model(model)
    if zero.is_partitioned(module):  # whatever stage3_gather_16bit_weights_on_model_save says
        return zero.full_state_dict(module, accelerator.is_main_process)
    return accelerator.get_state_dict(model)


def save_pretrained(run: Saved, output_dir: str, state_dict: dict[str, torch.Tensor]) -> None:
    """The policy (or its adapter), tokenizer and model card (`run.write_card`) as a Hugging Face model directory
    (main process only), from `model_state`."""
    model = run.accelerator.unwrap_model(run.model)
    model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
    run.processing_class.save_pretrained(output_dir)
    run.write_card(output_dir)


def path_of(output_dir: str, step: int) -> str:
    """Where checkpoint-<step> is (or will be)."""
    return os.path.join(output_dir, f"checkpoint-{step}")


def save(run: Saved, step: int, window: dict[str, list[float]]) -> str:
    """Write checkpoint-<step> (every process takes part), with `window`, the unfinished logging window (the
    metrics logger's `state_dict`); returns its path. The trainer state already names it when it is the best
    (`strategy.new_best`)."""
    acc, root = run.accelerator, run.args.output_dir
    final, tmp = path_of(root, step), os.path.join(root, f".tmp-checkpoint-{step}")
    acc.wait_for_everyone()
    writer = strategy.writer(run.args, acc)  # the main process, or each node's with save_on_each_node
    _phase(run, step, tmp, lambda: _fresh_directory(tmp) if writer else None)
    state_dict = model_state(run.model, acc)  # a collective for sharded models
    _phase(run, step, tmp, lambda: _write_process_files(run, tmp))
    _phase(run, step, tmp, lambda: _write_main_files(run, step, window, tmp, final, state_dict) if writer else None)
    acc.wait_for_everyone()
    return final


def add_evaluation(run: Saved, path: str) -> None:
    """After the evaluation of a step whose checkpoint was written before it (`GRPOTrainer._checkpoint`):
    the evaluation's row, the best checkpoint it makes (the trainer state names it: `strategy.new_best`) and the
    callbacks' states after on_evaluate go into the checkpoint's trainer_state.json, replaced atomically (a crash
    meanwhile leaves the complete checkpoint as it was); rotation then sees the new best. Every process calls
    it."""
    step = run.state.global_step
    writer = strategy.writer(run.args, run.accelerator)
    error = _add_to_state(run, path) if writer else None
    if collectives.any_process(run.accelerator, error is not None):
        detail = f"{type(error).__name__}: {error}" if error else "another process could not write its copy"
        raise CheckpointWriteError(
            f"Could not add the evaluation of step {step} to {os.path.join(path, STATE)} ({detail}); the "
            "checkpoint itself is complete and resumes (without that evaluation's row)."
        ) from error
    if writer:
        strategy.rotate(run.args.output_dir, run.args.save_total_limit, path, run.state.best_model_checkpoint)
    run.accelerator.wait_for_everyone()


def _add_to_state(run: Saved, path: str) -> OSError | None:
    file, tmp = os.path.join(path, STATE), os.path.join(path, STATE + ".tmp")
    try:
        with open(file) as f:
            state = json.load(f)
        state.update(
            log_history=run.state.log_history,
            stateful_callbacks=run.callbacks.states(),
            **strategy.best_state(run.state),
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


def _write_process_files(run: Saved, tmp: str) -> None:
    """What every process writes: its shards, and its state components (its generator states, its buffered
    rollouts, the mixed reference: `components`); none of it with save_only_model."""
    acc = run.accelerator
    if run.args.save_only_model:
        return
    if sharding.is_sharded(run.model):
        sharding.save_shards(run.model, run.optimizer, os.path.join(tmp, SHARDED))
    elif zero.in_use(acc):  # DeepSpeed's own engine checkpoint: every process writes its optimizer partition
        zero.save(acc, os.path.join(tmp, zero.STATE_DIR))
    for component in run.components:  # parts of the run that save themselves (StateComponent)
        component.save(tmp)


def _write_main_files(
    run: Saved, step: int, window: dict[str, list[float]], tmp: str, final: str, state_dict: dict[str, torch.Tensor]
) -> None:
    """What the main process writes: the model directory and trainer_state.json (the run's record, the best
    checkpoint, the callbacks' states); then the rename that makes the checkpoint exist, and the rotation."""
    save_pretrained(run, tmp, state_dict)
    state: dict[str, Any] = {"global_step": step, **run.record.fields(run.state, window)}
    state.update(
        save_only_model=run.args.save_only_model,
        **strategy.best_state(run.state),
        stateful_callbacks=run.callbacks.states(),
    )
    with open(os.path.join(tmp, STATE), "w") as f:
        json.dump(state, f, indent=1)
    _replace(tmp, final)  # the checkpoint exists only once it is complete
    strategy.rotate(run.args.output_dir, run.args.save_total_limit, final, run.state.best_model_checkpoint)


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


def _phase(run: Saved, step: int, tmp: str, work: Any) -> None:
    """Run one part of writing a checkpoint (every process calls it); if it fails on any process, every process
    raises a CheckpointWriteError after the temporary directory is removed, so that none waits for the others."""
    error = None
    try:
        work()
    except (OSError, RuntimeError, SafetensorError) as err:  # torch.save reports a full disk as RuntimeError
        error = err  # ("... unexpected pos"), safetensors as SafetensorError ("No space left on device")
    if not collectives.any_process(run.accelerator, error is not None):
        return
    if strategy.writer(run.args, run.accelerator):
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointWriteError(_write_failure(run.args.output_dir, step, error)) from error


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


def load(run: Saved, path: str) -> Resumed:
    """Restore everything `save` wrote into the run's parts (every process), and return what the trainer sets in
    its state and metrics window. Nothing is changed until every file has been read and checked."""
    acc, args = run.accelerator, run.args
    files.check_files(path)  # only regular files, before any library reads one (a FIFO would block it)
    state = files.read_state(path, run.max_steps, args.gradient_accumulation_steps)
    if state.get("save_only_model"):
        raise CheckpointError(
            f"{path} was saved with save_only_model=True: it holds the model only (no optimizer, schedule, random "
            f"generator states or buffered rollouts), so a run cannot resume from it. Start a new run from its "
            f"weights (model={path!r}, without resume_from_checkpoint), or resume from a checkpoint saved with "
            "save_only_model=False."
        )
    # read and checked, not applied (the record first: whether the checkpoint fits this run at all)
    record = run.record.read(path, state)
    components = [(c, c.read(path, state)) for c in run.components]
    best = strategy.read_best(state, path)
    if args.restore_callback_states_from_checkpoint:
        saved = state.get("stateful_callbacks") or {}
        files.apply(path, STATE, lambda: run.callbacks.restore(saved))  # a state a callback cannot take
    _load_model(run, path, sharding.is_sharded(run.model), zero.in_use(acc))
    resumed = run.record.restore(record)  # the record first, the generators last (`components.of`)
    for component, value in components:
        component.restore(value)
    return Resumed({**resumed.state, **best}, resumed.metrics_window)


def load_model_weights(run: Saved, path: str) -> None:
    """The model weights of checkpoint `path` into the run's model (every process), as a resume loads them:
    load_best_model_at_end."""
    files.check_files(path)
    _load_model(run, path, sharding.is_sharded(run.model), zero.in_use(run.accelerator))


def _load_model(run: Saved, path: str, sharded: bool, deepspeed: bool) -> None:
    acc = run.accelerator
    model = acc.unwrap_model(run.model)
    if sharded:  # the shards hold the whole trainable state, adapters included, and the optimizer's
        files.read(
            os.path.join(path, SHARDED),
            "sharded model and optimizer state",
            lambda p: sharding.load_shards(run.model, run.optimizer, p),
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
