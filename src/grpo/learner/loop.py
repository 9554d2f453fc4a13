"""The loop's own state: where the run is (micro-step, data position) and the rollout buffer that feeds the
micro-steps from one generation batch.

One generation batch feeds `steps_per_generation * num_iterations` micro-steps (a cycle): it is shuffled once
(seeded by the micro-step it was made at) and cut into `steps_per_generation` slices, taken in order and, with
num_iterations > 1, again. `RolloutBuffer.needs_generation` says when the next micro-step must generate.
Both pieces have a `state_dict` / `load_state_dict` pair, which is all a checkpoint reads of them;
`position_after_resume` is where a resumed run draws its next prompts (ignore_data_skip).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from grpo.config import ResolvedConfig
from grpo.data import datasets
from grpo.data import prompts as data
from grpo.learner.batch import TrainBatch


@dataclass
class LoopState:
    micro_step: int = 0  # micro-steps trained so far
    data_position: int = 0  # prompt blocks drawn so far (more than generations with dynamic sampling)

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_step, self.data_position = int(state["micro_step"]), int(state["data_position"])


def epoch_start(position: int, blocks_per_epoch: int) -> int:
    """The data position where the epoch holding `position` began (ignore_data_skip resumes there)."""
    return position - position % blocks_per_epoch


def position_after_resume(args: ResolvedConfig, dataset: Any, position: int) -> int:
    """The data position a resumed run draws its next prompts from: the checkpoint's, or with ignore_data_skip
    the start of its epoch (the HF Trainer restarts the epoch's dataloader without fast-forwarding it)."""
    if not args.ignore_data_skip:
        return position
    if datasets.is_stream(dataset):  # a stream's epoch is the run: start it over
        return 0
    blocks = data.prompts_per_generation(len(dataset), args.generation_batch_size // args.num_generations)
    return epoch_start(position, blocks)


class RolloutBuffer:
    """The current generation batch, as the slices its micro-steps train on."""

    def __init__(self, steps_per_generation: int, num_iterations: int, seed: int) -> None:
        self.steps_per_generation = steps_per_generation
        self.cycle = steps_per_generation * num_iterations  # micro-steps fed by one generation batch
        self.seed = seed
        self.slices: list[TrainBatch] = []

    def needs_generation(self, micro_step: int) -> bool:
        """Whether the micro-step `micro_step` starts a cycle (or nothing is buffered: a fresh run)."""
        return micro_step % self.cycle == 0 or not self.slices

    def mid_cycle(self, micro_step: int) -> bool:
        """Whether the next micro-step (`micro_step`) still trains on the buffered batch."""
        return bool(self.slices) and micro_step % self.cycle != 0

    def fill(self, batch: TrainBatch, micro_step: int) -> None:
        """Shuffle (every slice mixes groups) and cut the generation batch into steps_per_generation slices."""
        order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(self.seed + micro_step))
        batch = batch.select(order)
        self.slices = [batch.select(rows) for rows in torch.arange(len(batch)).chunk(self.steps_per_generation)]

    def take(self, micro_step: int) -> TrainBatch:
        return self.slices[(micro_step % self.cycle) % self.steps_per_generation]

    def state_dict(self) -> list[dict[str, Any]]:
        return [slice_.state_dict() for slice_ in self.slices]

    def load_state_dict(self, state: list[dict[str, Any]], device: Any) -> None:
        self.slices = [TrainBatch.from_state_dict(s).to(device) for s in state]


@dataclass
class TrainOutput:
    """What GRPOTrainer.train() returns (as the HF Trainer's TrainOutput)."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]


@dataclass
class Update:
    """One optimizer step's outcome: the loss of the whole batch, the gradient norm (NaN when fp16 loss scaling
    skipped the step) and the learning rate of the next step (as the HF Trainer logs it)."""

    loss: float
    grad_norm: float
    learning_rate: float


def schedule_length(train_dataset: Any, args: ResolvedConfig) -> tuple[int, int]:
    """(max_steps, optimizer steps per epoch) of a run on `train_dataset`."""
    a = args
    if datasets.is_stream(train_dataset):  # no length: max_steps is the run, and its only "epoch"
        if a.max_steps <= 0:
            raise ValueError(
                "train_dataset is a streaming dataset (no length): set max_steps, as TRL requires for an "
                "IterableDataset."
            )
        return a.max_steps, a.max_steps
    blocks = data.prompts_per_generation(len(train_dataset), a.generation_batch_size // a.num_generations)
    micro_per_epoch = blocks * a.steps_per_generation * a.num_iterations
    per_epoch = max(micro_per_epoch // a.gradient_accumulation_steps, 1)
    if a.max_steps > 0:
        return a.max_steps, per_epoch
    return max(math.ceil(a.num_train_epochs * per_epoch), 1), per_epoch
