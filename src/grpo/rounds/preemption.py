"""SIGTERM as a request, not a kill: clusters send it before preempting a job.

While training, the signal only sets a flag. Between steps the loop sees it, saves a checkpoint and exits. Inside
a step, every wait that can last (a reward function, a generation) checks the flag and raises `Preempted`, so a
hung reward function or a long rollout does not delay the exit; the trainer then saves the state at the end of
the previous step when nothing of it has changed yet (no optimizer step applied in this step), and exits. In the
evaluation that follows a step, the step is complete: it is saved as between steps (`GRPOTrainer._checkpoint`;
its checkpoint, when due, was written before the evaluation).

The flag itself (`Preempted`, `check`, `preemption_guard`) is `grpo.base.sigterm`'s, below everything that waits; this
module, above the checkpoints, decides what is saved.

A preempted run exits with status `EXIT_STATUS` (143, the shell's status for "terminated by SIGTERM"), never 0:
`python train.py && upload` does not upload a run that did not finish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from grpo import checkpoint
from grpo.base.sigterm import Preempted, check, preemption_guard, requested
from grpo.checkpoint import files
from grpo.distributed.accelerator import end_training, settle_processes

__all__ = [
    "EXIT_STATUS",
    "Preempted",
    "StepStart",
    "check",
    "preemption_guard",
    "requested",
    "safe_to_save",
    "save_and_exit",
]

logger = logging.getLogger("grpo")
EXIT_STATUS = 143


@dataclass(frozen=True)
class StepStart:
    """What a step changes before its optimizer step (generators, loop position, buffered rollouts, the metrics
    window, tokens seen), as the step found it."""

    rng: dict[str, Any]
    loop: dict[str, int]
    buffer: list
    metrics: dict[str, list[float]]
    tokens_seen: int

    @classmethod
    def capture(cls, loop: Any, buffer: Any, metrics: Any, tokens_seen: int) -> StepStart:
        """`loop` (`grpo.learner.loop.LoopState`), `buffer` (its `RolloutBuffer`) and `metrics` (the metrics
        logger) as they are now, this process's generators, and the trainer state's tokens seen."""
        return cls(files.rng_state(), loop.state_dict(), list(buffer.slices), metrics.state_dict(), tokens_seen)

    def restore(self, loop: Any, buffer: Any, metrics: Any) -> None:
        """Put the generators, `loop`, `buffer` and `metrics` back as `capture` found them (the trainer puts its
        state's `tokens_seen` back)."""
        files.set_rng_state(self.rng)
        loop.load_state_dict(self.loop)
        buffer.slices = self.buffer
        metrics.load_state_dict(self.metrics)


def safe_to_save(step: int, mid_step: bool, step_applied: bool, num_processes: int, agreed: bool) -> bool:
    """Whether the state at the end of the last complete step, `step`, can be saved after SIGTERM. Between steps
    it can. Inside a step (`mid_step`) it can while no optimizer step has been applied in it (the model and
    optimizer are as the last step left them; its `StepStart` puts the rest back), on one process, or on several
    that stopped together (`agreed`: at a round's gather or a tool loop's check, `grpo.base.sigterm`); several
    that stopped apart save nothing then."""
    apart = num_processes > 1 and not agreed
    return step > 0 and not (mid_step and (step_applied or apart))


def save_and_exit(
    save: Callable[[], Any] | None,
    metrics: Any,
    accelerator: Any,
    output_dir: str,
    save_only_model: bool,
    mid_step: bool,
) -> NoReturn:
    """After SIGTERM: `save` (the trainer's save of the last complete step; None where `safe_to_save` says it
    cannot be saved), then exit with status 143: the metrics logger closed, the process group torn down and
    settled, the newest checkpoint named."""
    if save is not None:
        save()
    metrics.close()
    end_training(accelerator)  # the group torn down at exit, settled, not left to interpreter shutdown
    settle_processes(accelerator)
    newest = checkpoint.checkpoints(output_dir)
    where = f"the newest checkpoint is {newest[-1][1]}" if newest else "no checkpoint was written"
    how = (
        "Checkpoints hold the model only (save_only_model=True): none can resume the run."
        if save_only_model
        else "Resume with trainer.train(resume_from_checkpoint=True)."
    )
    logger.warning(
        "SIGTERM received%s: %s; exiting with status %d. %s",
        " during a step" if mid_step else "",
        where,
        EXIT_STATUS,
        how,
    )
    raise SystemExit(EXIT_STATUS)
