"""When checkpoints are written, which one is the best, who writes them, and where a resumed run starts: the
HF Trainer's save_strategy, metric_for_best_model / greater_is_better, save_total_limit, load_best_model_at_end,
save_on_each_node, resume_from_checkpoint and ignore_data_skip, for grpo's loop.

- save_strategy "steps": every save_steps optimizer steps; "epoch": at the end of every epoch (steps_per_epoch
  optimizer steps) and at the last step, where the HF Trainer's last, possibly partial, epoch ends; "best":
  whenever the logged metric_for_best_model improves; "no": never (SIGTERM still saves, `grpo.rounds.preemption`).
- The metric is read in the row logged at a step (metrics.jsonl). With an eval dataset, an "eval_" name is the
  evaluation's metric, read at the steps it runs (the HF Trainer's meaning); without one, "eval_reward" names the
  logged training "reward" (the HF Trainer adds that prefix to find its evaluation metric). A checkpoint is
  ranked by the metric logged at its step; `state.best_metric`,
  `best_global_step` and `best_model_checkpoint` describe the best checkpoint saved so far (with "best" that is
  also the best value logged) and persist in trainer_state.json.
- Rotation (save_total_limit) keeps the newest checkpoint and the best one; load_best_model_at_end ends train()
  by loading the best checkpoint's model weights.
- save_on_each_node: the main process of every node writes the shared files (no shared disk), as the HF
  Trainer's `should_save`.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from typing import Any

from grpo.checkpoint.files import CheckpointError, checkpoints
from grpo.checkpoint.saved import Saved
from grpo.config import ResolvedConfig
from grpo.distributed import collectives, sharding, zero
from grpo.observe import reporting

logger = logging.getLogger("grpo")
BEST_FIELDS = ("best_metric", "best_global_step", "best_model_checkpoint")


# ---- the decisions, as pure functions -------------------------------------------------------------------------


def save_due(strategy: str, step: int, save_every: int, steps_per_epoch: int, max_steps: int, new_best: bool) -> bool:
    """Whether optimizer step `step` ends with a checkpoint under `strategy`."""
    if strategy == "steps":  # and the last step, as the HF Trainer (5.x) saves it
        return step % save_every == 0 or step == max_steps
    if strategy == "epoch":
        return step % steps_per_epoch == 0 or step == max_steps
    if strategy == "best":
        return new_best
    return False


def improves(value: float | None, best: float | None, greater_is_better: bool | None) -> bool:
    """Whether a logged value beats the best so far (a missing or non-finite value never does; greater_is_better
    None, as without metric_for_best_model: the lower the better)."""
    if value is None:
        return False
    if best is None:
        return True
    return value > best if greater_is_better else value < best


def metric_key(name: str, row: dict[str, Any]) -> str | None:
    """The key of `row` that metric_for_best_model names, with or without the HF Trainer's "eval_" prefix."""
    for key in (name, name.removeprefix("eval_")):
        if key in row:
            return key
    return None


def writes_files(save_on_each_node: bool, is_main_process: bool, is_local_main_process: bool) -> bool:
    """Whether this process writes a checkpoint's shared files (model, optimizer, trainer state) and the final
    model: the main process, or with save_on_each_node every node's main process."""
    return is_local_main_process if save_on_each_node else is_main_process


def writer(args: ResolvedConfig, accelerator: Any) -> bool:
    """Whether this process writes the shared files (`writes_files`)."""
    return writes_files(args.save_on_each_node, accelerator.is_main_process, accelerator.is_local_main_process)


# ---- construction: settings that could never do what they say ------------------------------------------------


def check(a: ResolvedConfig, max_steps: int, steps_per_epoch: int, model: Any, accelerator: Any) -> None:
    """Refuse, before any step, settings under which the best checkpoint could not be known or loaded (`model`: the
    policy as prepared)."""
    needs_metric = a.save_strategy == "best" or a.load_best_model_at_end
    if needs_metric and a.logging_strategy == "no":
        raise ValueError(
            f"GRPOConfig.metric_for_best_model ({a.metric_for_best_model!r}) is read from the logged metrics, but "
            "logging_strategy='no' logs none: set logging_strategy='steps' (save_strategy='best' and "
            "load_best_model_at_end need it)."
        )
    if not a.load_best_model_at_end:
        return
    if a.save_strategy == "no":
        raise ValueError(
            "GRPOConfig.load_best_model_at_end=True loads the best checkpoint, but save_strategy='no' writes none: "
            "set save_strategy to 'best', 'steps' or 'epoch'."
        )
    _check_saves_are_logged(a, max_steps, steps_per_epoch)
    if a.save_only_model and (sharding.is_sharded(model) or zero.in_use(accelerator)):
        raise ValueError(
            "GRPOConfig.load_best_model_at_end with save_only_model=True is not supported for a sharded model "
            "(FSDP, DeepSpeed): its weights are loaded back from the shards, which save_only_model leaves out. "
            "Set save_only_model=False."
        )


def _check_saves_are_logged(a: ResolvedConfig, max_steps: int, steps_per_epoch: int) -> None:
    """A checkpoint is ranked by the metric logged at its step: every save must fall on a logging step (the HF
    Trainer asks the same of save_steps and eval_steps)."""
    if a.save_strategy == "best":
        return
    every = reporting.interval(a.save_steps, max_steps)
    unranked = [
        step
        for step in range(1, max_steps + 1)
        if save_due(a.save_strategy, step, every, steps_per_epoch, max_steps, False)
        and not reporting.should_log(a, step, max_steps, steps_per_epoch)
    ]
    if unranked:
        saves = f"save_steps={a.save_steps}" if a.save_strategy == "steps" else "an epoch's end"
        raise ValueError(
            f"GRPOConfig.load_best_model_at_end ranks checkpoints by the metric logged at their step, but the "
            f"checkpoints of steps {unranked[:3]} ({saves}) fall on no logging step (logging_strategy="
            f"{a.logging_strategy!r}, logging_steps={a.logging_steps}). Make save_steps a multiple of logging_steps, "
            "or use save_strategy='best'."
        )


# ---- during training --------------------------------------------------------------------------------------------


def metric_at(run: Saved, step: int) -> float | None:
    """metric_for_best_model as logged at `step` (None when unset, not logged then, or not finite), the same on
    every process (the mean of the processes' values). A name no logged row has ever had is an error naming
    the logged metrics."""
    name = run.args.metric_for_best_model
    rows = run.state.log_history
    if name is None or not rows or rows[-1].get("step") != step:
        return None
    row = rows[-1]
    if run.evaluated and name.startswith("eval_"):  # with an eval dataset, the evaluation's, read when it runs
        return _number(run.accelerator, row.get(name))
    key = metric_key(name, row)
    if key is None and not any(metric_key(name, r) for r in rows[:-1]):
        available = ", ".join(sorted(k for k in row if k not in ("step", "epoch")))
        raise ValueError(
            f"GRPOConfig.metric_for_best_model={name!r} is not a logged metric (step {step} logged: {available}). "
            "Set it to one of these (an 'eval_' prefix is accepted)."
        )
    return _number(run.accelerator, row.get(key) if key is not None else None)


def _number(accelerator: Any, value: Any) -> float | None:
    """A logged value as a finite float the same on every process (their mean), or None."""
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    number = collectives.process_mean(accelerator, number)
    return number if math.isfinite(number) else None


def should_save(run: Saved) -> bool:
    """Whether the step just finished (and logged) ends with a checkpoint (every process calls it)."""
    a, state = run.args, run.state
    step = state.global_step
    new_best = improves(metric_at(run, step), state.best_metric, a.greater_is_better)
    return save_due(
        a.save_strategy,
        step,
        reporting.interval(a.save_steps, run.max_steps),
        run.steps_per_epoch,
        run.max_steps,
        new_best,
    )


def new_best(run: Saved, step: int, path: str) -> dict[str, Any] | None:
    """Before checkpoint-<step> is written at `path` (every process): the best-checkpoint fields of the trainer
    state when the metric logged at its step beats the best saved so far (it becomes the best checkpoint, and its
    trainer_state.json already says so), else None."""
    value = metric_at(run, step)
    if not improves(value, run.state.best_metric, run.args.greater_is_better):
        return None
    return dict(zip(BEST_FIELDS, (value, step, path)))


def best_state(state: Any) -> dict[str, Any]:
    return {name: getattr(state, name) for name in BEST_FIELDS}


def read_best(saved: dict[str, Any], path: str) -> dict[str, Any]:
    """The best-checkpoint fields of a checkpoint's trainer_state.json, checked (absent in older checkpoints:
    none). A best checkpoint that no longer exists is forgotten with a warning, as the HF Trainer does; its metric
    stays, so that later checkpoints must still beat it."""
    metric, step, best = (saved.get(name) for name in BEST_FIELDS)
    number = isinstance(metric, (int, float)) and not isinstance(metric, bool) and math.isfinite(metric)
    if not (
        (metric is None or number)
        and (step is None or (type(step) is int and step >= 1))
        and (best is None or isinstance(best, str))
    ):
        raise CheckpointError(
            f"{os.path.join(path, 'trainer_state.json')}: best_metric / best_global_step / best_model_checkpoint "
            f"are {metric!r}, {step!r}, {best!r}; they must be a number, a step and a path (or null)."
        )
    if best is not None and not os.path.isdir(best):
        logger.warning("The best checkpoint %s recorded in %s no longer exists; it is forgotten.", best, path)
        best = None
    return dict(zip(BEST_FIELDS, (metric, step, best)))


def rotate(root: str, limit: int | None, keep: str, best: str | None) -> None:
    """Delete the oldest complete checkpoints until `limit` are left (None: keep all), never the one just
    written (`keep`), the newest, or the best one: with those protected, more than `limit` may stay."""
    if not limit or limit < 1:
        return
    found = [path for _, path in checkpoints(root)]
    protected = {os.path.normpath(p) for p in [keep, best, *found[-1:]] if p}
    remaining = len(found)
    for path in found:
        if remaining <= max(limit, len(protected)):
            return
        if os.path.normpath(path) not in protected:
            shutil.rmtree(path, ignore_errors=True)
            remaining -= 1


# ---- resuming and ending ----------------------------------------------------------------------------------------


def resume_target(argument: str | bool | None, config_value: str | None) -> str | bool | None:
    """What train() resumes from: its argument, or (None) the config's resume_from_checkpoint, where command lines
    write True as "true". None or False: start afresh."""
    value = config_value if argument is None else argument
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "none", ""):
        value = value.strip().lower() == "true"
    return value or None


def best_to_load(run: Saved) -> str | None:
    """load_best_model_at_end: the best checkpoint, whose model weights end the run (every process calls it), or
    None (not asked for, or no checkpoint was ranked)."""
    state, name = run.state, run.args.metric_for_best_model
    if not run.args.load_best_model_at_end:
        return None
    best = state.best_model_checkpoint
    if collectives.any_process(run.accelerator, best is None or not os.path.isdir(best)):
        logger.warning(
            "load_best_model_at_end: no saved checkpoint has a logged %s, so the model stays as the last step left it.",
            name,
        )
        return None
    assert best is not None  # every process has it
    logger.info("Loading the best model from %s (%s = %s).", best, name, state.best_metric)
    return best
