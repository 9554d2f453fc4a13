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
import os
from dataclasses import dataclass
from typing import Any, NoReturn

from grpo import checkpoint
from grpo.base.sigterm import Preempted, check, preemption_guard, requested
from grpo.checkpoint import files
from grpo.checkpoint.run import PreemptibleRun
from grpo.distributed.accelerator import end_training, settle_processes

__all__ = ["EXIT_STATUS", "Preempted", "StepStart", "check", "preemption_guard", "requested", "save_and_exit"]

logger = logging.getLogger("grpo")
EXIT_STATUS = 143


@dataclass
class StepStart:
    """What a step changes before its optimizer step (generators, loop position, buffered rollouts, the metrics
    window, tokens seen), as the step found it."""

    rng: dict[str, Any]
    loop: dict[str, int]
    buffer: list
    metrics: dict[str, list[float]]
    tokens_seen: int

    @classmethod
    def capture(cls, trainer: PreemptibleRun) -> StepStart:
        return cls(
            files.rng_state(),
            trainer.loop.state_dict(),
            list(trainer.buffer.slices),
            trainer.metrics.state_dict(),
            trainer.state.num_input_tokens_seen,
        )

    def restore(self, trainer: PreemptibleRun) -> None:
        files.set_rng_state(self.rng)
        trainer.loop.load_state_dict(self.loop)
        trainer.buffer.slices = self.buffer
        trainer.metrics.load_state_dict(self.metrics)
        trainer.state.num_input_tokens_seen = self.tokens_seen


def save_and_exit(trainer: PreemptibleRun, step_start: StepStart | None, agreed: bool = False) -> NoReturn:
    """After SIGTERM: save the state at the end of the last complete step when that is safe, and exit with status
    143. Between steps (`step_start` None) it is. Inside a step it is while no optimizer step has been applied in
    it (the model and optimizer are as the last step left them; `step_start` puts the rest back), on one process,
    or on several that stopped together (`agreed`: at a round's gather or a tool loop's check, `grpo.base.sigterm`);
    several that stopped apart save nothing then."""
    trainer.rounds.halt()  # an asynchronous producer stops before anything is saved or settled
    step = trainer.state.global_step
    mid_step = step_start is not None
    apart = trainer.accelerator.num_processes > 1 and not agreed
    safe = step > 0 and not (mid_step and (trainer.step_applied or apart))
    if safe and step_start is not None:
        step_start.restore(trainer)
    if safe and not os.path.exists(os.path.join(trainer.args.output_dir, f"checkpoint-{step}")):
        checkpoint.save(trainer, step)
    trainer.metrics.close()
    end_training(trainer.accelerator)  # the group torn down at exit, settled, not left to interpreter shutdown
    settle_processes(trainer.accelerator)
    newest = checkpoint.checkpoints(trainer.args.output_dir)
    where = f"the newest checkpoint is {newest[-1][1]}" if newest else "no checkpoint was written"
    how = (
        "Checkpoints hold the model only (save_only_model=True): none can resume the run."
        if trainer.args.save_only_model
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
