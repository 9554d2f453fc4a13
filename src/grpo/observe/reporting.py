"""When the trainer logs, how loud each process is, what it counts as input tokens, and when it hands cached
memory back: the logging fields of `GRPOConfig`, with the HF Trainer's meaning (transformers 5.24).

- `logging_strategy`: "steps" logs every `logging_steps` optimizer steps, "epoch" at the end of each epoch
  (`steps_per_epoch` optimizer steps), "no" never; "steps" and "epoch" also log the last step (the run's
  summary, `train()`'s metrics), `logging_first_step` also step 1 (with "no" too, as in the HF Trainer). A
  logged step appends one row to `state.log_history` and metrics.jsonl; evaluations append theirs, and `train()`
  adds the HF Trainer's summary record to the last row (`with_summary`; not in metrics.jsonl).
- `log_level` / `log_level_replica`: the level of the "grpo" logger and of transformers' logging on a process
  that is a main process for logging, and on the others; "passive" leaves it as it is. With
  `log_on_each_node` (the default) each node's first process is a main one, otherwise only the global first.
- `include_num_input_tokens_seen`: the input tokens of grpo are the prompt and completion tokens of every
  generated row that is trained on (every process's rows, counted once per generation batch however many times
  the batch is trained on). "non_padding" counts each row's own tokens (the count TRL logs as `num_tokens`);
  "all" counts the training batch as collated, padding included: each process's rows times its padded prompt
  and completion widths (its longest, or with `pad_to_multiple_of` rounded up to a multiple).
- `torch_empty_cache_steps`: every N optimizer steps the allocator's cached free memory goes back to the
  device (or, on the CPU, to the system).
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch
import transformers

from grpo.config import ResolvedConfig, validation
from grpo.perf import allocator

logger = logging.getLogger("grpo")

# GRPOConfig's level names -> logging's levels ("passive": leave the level as it is)
LOG_LEVELS = {name: None if name == "passive" else logging.getLevelName(name.upper()) for name in validation.LOG_LEVELS}
TOKENS_SEEN = "num_input_tokens_seen"  # the HF Trainer's name for the row's count


def should_log(args: ResolvedConfig, step: int, max_steps: int, steps_per_epoch: int) -> bool:
    """Whether optimizer step `step` (1-based) writes a metrics row."""
    if step == 1 and args.logging_first_step:
        return True
    if args.logging_strategy == "no":
        return False
    if step == max_steps:
        return True
    if args.logging_strategy == "epoch":
        return step % steps_per_epoch == 0
    return step % interval(args.logging_steps, max_steps) == 0


def interval(value: float, total: int) -> int:
    """logging_steps: an int, or a fraction (< 1) of the total number of steps."""
    return max(int(math.ceil(value * total)) if value < 1 else int(value), 1)


def is_logging_main(accelerator: Any, log_on_each_node: bool) -> bool:
    """Whether this process logs as a main process: each node's first one with `log_on_each_node`, else only
    the first process of the whole run."""
    return accelerator.is_local_main_process if log_on_each_node else accelerator.is_main_process


def process_log_level(args: ResolvedConfig, logging_main: bool) -> int | None:
    """This process's log level; None: leave it as it is ("passive")."""
    return LOG_LEVELS[args.log_level if logging_main else args.log_level_replica]


def configure_logging(args: ResolvedConfig, accelerator: Any) -> None:
    """At the trainer's start: this process's log levels, and a warning for what logging settings would hide."""
    set_log_levels(args, accelerator)
    warn_unlogged(args)


def set_log_levels(args: ResolvedConfig, accelerator: Any) -> int | None:
    """Apply this process's log level to the "grpo" logger and to transformers' logging (as the HF Trainer
    does at its start); returns the level set, None when passive."""
    level = process_log_level(args, is_logging_main(accelerator, args.log_on_each_node))
    if level is None:
        return None
    grpo_logger = logging.getLogger("grpo")
    grpo_logger.setLevel(level)
    if level < logging.WARNING and not grpo_logger.hasHandlers():
        # Python's last-resort handler prints warnings only: asking for info or debug must show them
        grpo_logger.addHandler(logging.StreamHandler())
    transformers.utils.logging.set_verbosity(level)
    return level


def warn_unlogged(args: ResolvedConfig) -> None:
    """Settings that show only at a logging step, when no step will ever log."""
    if args.logging_strategy == "no" and not args.logging_first_step and args.log_completions:
        warnings.warn(
            "log_completions=True shows and saves completions at logging steps, and logging_strategy='no' has "
            "none; set logging_strategy='steps' (or logging_first_step=True) to see them.",
            stacklevel=5,  # the GRPOTrainer(...) call (through assemble)
        )


def count_tokens(metrics: Any, seen: int, rollout: Any, batch: Any, accelerator: Any, mode: str) -> int:
    """Count one generation batch's input tokens after `seen` (the trainer state's `num_input_tokens_seen`), and
    return the new count, which the trainer sets there (TRL's count: the rows of `rollout`, every process's,
    without padding, tool results not counted). The `num_tokens` column is that count, always; the
    `num_input_tokens_seen` column is as `mode` asks, "all" from `batch`, this process's collated share (padding
    included), summed over the processes."""
    seen += sum(len(p) + sum(m) for p, m in zip(rollout.prompt_ids, rollout.loss_mask))
    metrics.set_total("num_tokens", seen)
    if mode == "non_padding":
        metrics.set_total(TOKENS_SEEN, seen)
    elif mode == "all":
        local = torch.tensor(batch.prompt_ids.numel() + batch.completion_ids.numel(), device=accelerator.device)
        padded = int(accelerator.reduce(local, reduction="sum").item())
        metrics.set_total(TOKENS_SEEN, metrics.totals.get(TOKENS_SEEN, 0) + padded)
    return seen


def release_memory_on_schedule(args: ResolvedConfig, step: int, device: Any) -> bool:
    """Every `torch_empty_cache_steps` optimizer steps, hand the allocator's cached free memory back; returns
    whether it did."""
    every = args.torch_empty_cache_steps
    if every is None or step % every != 0:
        return False
    allocator.release_cached_memory(device)
    return True


def train_summary(
    args: ResolvedConfig, state: Any, seconds: float, first_step: int, training_loss: float
) -> dict[str, float]:
    """The HF Trainer's end-of-training metrics for `train()`'s output: `train_runtime` (s),
    `train_samples_per_second` (completions trained on: per_device_train_batch_size x gradient_accumulation_steps x
    processes a step), `train_steps_per_second`, `train_loss` and `epoch`, over the steps this call ran (from
    `first_step`, the step it resumed at)."""
    seconds, steps_run, epoch = max(seconds, 1e-9), state.global_step - first_step, state.epoch
    samples = steps_run * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    return {
        "train_runtime": round(seconds, 4),
        "train_samples_per_second": round(samples / seconds, 3),
        "train_steps_per_second": round(steps_run / seconds, 3),
        "total_flos": float(state.total_flos),
        "train_loss": training_loss,
        "epoch": epoch,
    }


def with_summary(
    rows: list[dict[str, Any]], summary: dict[str, float], step: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """log_history ended with the HF Trainer's end-of-training record (`train_loss`, `train_runtime`, `total_flos`,
    ..., `epoch`, `step`), so `log_history[-1]` holds it, as the HF Trainer's and TRL's do; and the record, for the
    callbacks' on_log. grpo always logs the last step, so the record completes that step's row (which thus also
    holds the run's last metrics, as TRL's record holds those logged since its last row); a run whose last row is
    not that step's training row (an evaluation after it, a run resumed at its end) gets a row of its own with the
    latest training metrics. `rows` is left as it is: the trainer sets the new history."""
    record = {**summary, "step": step}
    if rows and rows[-1].get("step") == step and "loss" in rows[-1]:
        return [*rows[:-1], {**rows[-1], **record}], record
    latest: dict[str, Any] = next((r for r in reversed(rows) if "loss" in r), {})
    skip = ("loss", "grad_norm", "learning_rate", "step", "epoch")
    return [*rows, {**{k: v for k, v in latest.items() if k not in skip}, **record}], record


def non_embedding_parameters(model: Any) -> int:
    counter = getattr(model, "num_parameters", None)
    return counter(exclude_embeddings=True) if counter else sum(p.numel() for p in model.parameters())


def micro_batch_flos(parameters: int, batch: Any) -> float:
    """The HF Trainer's `total_flos` estimate for one training micro-batch: 6 x non-embedding parameters x tokens
    (prompt and completion positions, padding included, as the HF Trainer counts `input_ids`)."""
    return float(6 * parameters * (batch.prompt_ids.numel() + batch.completion_ids.numel()))
