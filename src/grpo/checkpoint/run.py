"""What checkpointing reads of a run, as types: the checkpoint package takes a `CheckpointedRun` (the trainer is
one), never the trainer's class, so it stays below the trainer and names every attribute it depends on."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from accelerate import Accelerator
from transformers import TrainerState

from grpo.config import ResolvedConfig


class StateComponent(Protocol):
    """A part of a run's state that saves and loads itself (torchtitan's Stateful, in two phases): `save` writes
    its files into the checkpoint being written (every process calls it), `read` reads and checks them without
    changing anything (an error names the file), `restore` applies what `read` returned once every file of the
    checkpoint has been read. A component may also have `fields() -> dict`: entries of trainer_state.json, which
    the checkpoint's writer collects (`components.TrainingRecord`: the run's position, logs and geometry). The
    trainer lists its components in `state_components`."""

    name: str

    def save(self, directory: str) -> None: ...

    def read(self, checkpoint: str, state: dict[str, Any]) -> Any: ...

    def restore(self, value: Any) -> None: ...


class CheckpointedRun(Protocol):
    """A run as `grpo.checkpoint` saves and loads it: the model and optimizer (whole, sharded or DeepSpeed's), the
    tokenizer or processor, the HF TrainerState (step, log history, best checkpoint), the callbacks' states, the
    parts that save themselves, and the settings and lengths that decide when and where to save."""

    accelerator: Accelerator
    args: ResolvedConfig  # output_dir, save_* settings, metric_for_best_model, ...
    model: torch.nn.Module  # as prepared: wrapped, sharded or DeepSpeed's engine
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    processing_class: Any
    state: TrainerState
    callback_handler: Any  # `grpo.observe.callbacks.Callbacks`: states() / restore()
    state_components: list[StateComponent]
    max_steps: int
    steps_per_epoch: int

    def write_model_card(self, output_dir: str) -> str: ...  # README.md's path


class PreemptibleRun(CheckpointedRun, Protocol):
    """A run as its components record it (`components.of_run`) and `grpo.rounds.preemption` saves it after SIGTERM: also
    what a step changes before its optimizer step."""

    loop: Any  # `grpo.learner.loop.LoopState`: micro-step, data position
    buffer: Any  # `grpo.learner.loop.RolloutBuffer`
    metrics: Any  # `grpo.observe.metrics.MetricsLogger` (made when training starts)
    loss_terms: Any  # `grpo.algo.loss_terms.LossTerms`: the entropy control
    step_applied: bool  # whether the current step's optimizer step has been applied
    rounds: Any  # `grpo.rounds.sequential.Rounds`: an asynchronous producer thread, halted before saving
