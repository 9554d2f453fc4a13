"""What a checkpoint holds of a run, as values: `Saved` (the model, its optimizer, its tokenizer and card, the
trainer state, the callbacks, the record and the parts that save themselves, the settings), built once by the
trainer's assembly and handed to `grpo.checkpoint.save` and `load`. The checkpoint package reads the trainer state
and never writes it: `load` returns what a checkpoint sets there (`Resumed`), and the trainer sets it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from accelerate import Accelerator
from transformers import TrainerState

from grpo.config import ResolvedConfig

if TYPE_CHECKING:
    from grpo.checkpoint.components import TrainingRecord
    from grpo.observe.callbacks import Callbacks


class StateComponent(Protocol):
    """A part of a run's state that saves and loads itself (torchtitan's Stateful, in two phases): `save` writes
    its files into the checkpoint being written (every process calls it), `read` reads and checks them without
    changing anything (an error names the file), `restore` applies what `read` returned once every file of the
    checkpoint has been read. The trainer lists its components in `state_components`."""

    name: str

    def save(self, directory: str) -> None: ...

    def read(self, checkpoint: str, state: dict[str, Any]) -> Any: ...

    def restore(self, value: Any) -> None: ...


@dataclass(frozen=True)
class Saved:
    """A run as checkpoints save and load it: the model and optimizer (whole, sharded or DeepSpeed's), the tokenizer
    or processor and the model card's writer (the model directory), the HF TrainerState (read only: step, log
    history, best checkpoint), the callbacks' states, the run's record in trainer_state.json and the parts that save
    themselves, and the settings and lengths that decide when and where to save."""

    args: ResolvedConfig  # output_dir, save_* settings, metric_for_best_model, ...
    accelerator: Accelerator
    model: torch.nn.Module  # as prepared: wrapped, sharded or DeepSpeed's engine
    optimizer: torch.optim.Optimizer  # a sharded model's shards hold it; else the `Optimization` component
    processing_class: Any
    write_card: Callable[..., str]  # (directory, **card fields) -> README.md written there
    state: TrainerState
    callbacks: Callbacks  # states() / restore()
    record: TrainingRecord  # trainer_state.json's record of the run
    components: list[StateComponent]  # restored in this order, after the record (the generators last)
    max_steps: int
    steps_per_epoch: int
    evaluated: bool  # an eval dataset's evaluations log the eval_ metrics metric_for_best_model may name


@dataclass(frozen=True)
class Resumed:
    """What a loaded checkpoint sets in the trainer: its TrainerState's fields (`state`, by name: the step, epoch,
    tokens seen, FLOPs, log history and best checkpoint) and the unfinished logging window (`metrics_window`)."""

    state: dict[str, Any]
    metrics_window: dict[str, list[float]]
