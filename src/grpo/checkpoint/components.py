"""The parts of a run's state that save and load themselves in checkpoints (`grpo.checkpoint.StateComponent`).

`grpo.checkpoint.save` calls each component's `save` with the checkpoint being written (on every process, unless
save_only_model); `load` calls every `read` before changing anything, then every `restore`, in the list's order,
after the model, optimizer and trainer state: the random generators come last, so nothing restored after them
draws from them. Components hold what they save, not the trainer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from grpo.checkpoint import files, strategy
from grpo.distributed import sharding, zero

OPTIMIZER, SCHEDULER, SCALER = "optimizer.pt", "scheduler.pt", "scaler.pt"


class Optimization:
    """The optimizer (`optimizer.pt`; a sharded model's or DeepSpeed's own files hold it instead), the learning-rate
    schedule (`scheduler.pt`) and the fp16 loss scale (`scaler.pt`), written by the checkpoint's writer."""

    name = "optimization"

    def __init__(self, optimizer: Any, scheduler: Any, scaler: Any, own_file: bool, writer: bool, device: Any) -> None:
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.own_file, self.writer, self.device = own_file, writer, device

    def save(self, directory: str) -> None:
        if not self.writer:
            return
        if self.own_file:
            torch.save(self.optimizer.state_dict(), os.path.join(directory, OPTIMIZER))
        torch.save(self.scheduler.state_dict(), os.path.join(directory, SCHEDULER))
        if self.scaler is not None:  # fp16 loss scaling: the current scale and its growth tracker
            torch.save(self.scaler.state_dict(), os.path.join(directory, SCALER))

    def read(self, checkpoint: str, state: dict[str, Any]) -> tuple[str, Any, Any, Any]:
        optimizer = None
        if self.own_file:
            optimizer = files.load_tensors(os.path.join(checkpoint, OPTIMIZER), "optimizer state", self.device)
        scheduler = files.load_tensors(os.path.join(checkpoint, SCHEDULER), "learning-rate schedule state")
        scaler = None
        if self.scaler is not None and os.path.exists(os.path.join(checkpoint, SCALER)):
            scaler = files.load_tensors(os.path.join(checkpoint, SCALER), "fp16 loss-scaler state")
        return checkpoint, optimizer, scheduler, scaler

    def restore(self, value: tuple[str, Any, Any, Any]) -> None:
        path, optimizer, scheduler, scaler = value
        if optimizer is not None:
            files.apply(path, OPTIMIZER, lambda: self.optimizer.load_state_dict(optimizer))
        files.apply(path, SCHEDULER, lambda: self.scheduler.load_state_dict(scheduler))
        if scaler is not None:
            self.scaler.load_state_dict(scaler)


class GeneratorStates:
    """Python's, NumPy's, torch's and CUDA's random generators of this process (`rng_state_<rank>.pt`)."""

    name = "random generators"

    def __init__(self, rank: int) -> None:
        self.file = f"rng_state_{rank}.pt"

    def save(self, directory: str) -> None:
        torch.save(files.rng_state(), os.path.join(directory, self.file))

    def read(self, checkpoint: str, state: dict[str, Any]) -> dict[str, Any]:
        return files.load_rng_state(os.path.join(checkpoint, self.file))

    def restore(self, value: dict[str, Any]) -> None:
        files.set_rng_state(value)


class BufferedRollouts:
    """This process's buffered batches when the checkpoint falls inside a generation cycle (`rollouts_<rank>.pt`):
    the next steps train on them. A missing file is an error: generating them again would not resume exactly."""

    name = "buffered rollouts"

    def __init__(self, buffer: Any, loop: Any, rank: int, device: Any) -> None:
        self.buffer, self.loop, self.device = buffer, loop, device
        self.file = f"rollouts_{rank}.pt"

    def save(self, directory: str) -> None:
        if self.buffer.mid_cycle(self.loop.micro_step):
            torch.save(self.buffer.state_dict(), os.path.join(directory, self.file))

    def read(self, checkpoint: str, state: dict[str, Any]) -> list[dict[str, Any]]:
        name = os.path.join(checkpoint, self.file)
        if not state.get("rollouts", state["micro_step"] % self.buffer.cycle != 0):
            return []
        if not os.path.exists(name):
            raise files.invalid(
                name,
                f"missing, but step {state['global_step']} falls inside a generation cycle: the next steps train "
                "on these buffered rollouts, and generating them again would not resume exactly",
            )
        saved = files.load_tensors(name, "buffered rollouts", self.device)
        if not isinstance(saved, list) or not all(isinstance(b, dict) for b in saved):
            raise files.invalid(name, "is not a list of buffered batches")
        for batch in saved:  # written by grpo 0.1.0 before the rollout interface: the token count was run state
            if "truncated" in batch:
                del batch["truncated"]
                batch["num_items_in_batch"] = state.get("num_items", 0.0)
        return saved

    def restore(self, value: list[dict[str, Any]]) -> None:
        self.buffer.load_state_dict(value, self.device)


def of_run(trainer: Any, extra: Sequence[Any] = ()) -> list[Any]:
    """A run's components, from a trainer being built (after `prepare`): its optimization, its buffered
    rollouts, the `extra` ones (the mixed reference), its generators last."""
    acc = trainer.accelerator
    # where saved tensors go: accelerate numbers CPU processes' devices ("cpu:1"), which torch.load rejects
    device = "cpu" if acc.device.type == "cpu" else acc.device
    own_file = not sharding.is_sharded(trainer.model) and not zero.in_use(acc)  # else the shards hold it
    optimization = Optimization(
        trainer.optimizer, trainer.lr_scheduler, acc.scaler, own_file, strategy.writer(trainer), device
    )
    rollouts = BufferedRollouts(trainer.buffer, trainer.loop, acc.process_index, device)
    return [optimization, rollouts, *extra, GeneratorStates(acc.process_index)]
