"""The run's record in trainer_state.json (`TrainingRecord`) and the parts of a run's state that save and load
themselves in checkpoints (`grpo.checkpoint.StateComponent`).

`grpo.checkpoint.save` calls each component's `save` with the checkpoint being written (on every process, unless
save_only_model); `load` calls every `read` before changing anything, then the record's `restore`, then every
component's, in the list's order, after the model and optimizer: the random generators come last, so nothing
restored after them draws from them. Components hold what they save, not the trainer; the record hands back what
belongs to the trainer's state (`Resumed`), which the trainer sets.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from grpo.checkpoint import files, strategy
from grpo.checkpoint.saved import Resumed, StateComponent
from grpo.config import ResolvedConfig
from grpo.distributed import sharding, zero

OPTIMIZER, SCHEDULER, SCALER = "optimizer.pt", "scheduler.pt", "scaler.pt"


# settings that decide which prompts, completions and batches each step sees: a resume must keep them
RUN_GEOMETRY = (
    "seed",
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "generation_batch_size",
    "steps_per_generation",
    "num_iterations",
    "shuffle_dataset",
    "data_seed",
)


class TrainingRecord:
    """The run's record in trainer_state.json: the loop's position (micro-step, data position), tokens seen, FLOPs,
    the log history and the unfinished logging window, the entropy control, whether rollouts were buffered, and
    what a resume must keep (the run's geometry, world size and dataset size, and the config). `fields` is what the
    checkpoint's writer puts in trainer_state.json, from the trainer state and the logging window it is given;
    `read` checks that the checkpoint fits this run (the error names every difference); `restore` applies the
    loop's position and the entropy control, and returns what the trainer sets (`Resumed`). Given the objects it
    records at construction, not the trainer."""

    name = "trainer state"

    def __init__(self, loop: Any, buffer: Any, loss_terms: Any, run: dict[str, Any]) -> None:
        self.loop, self.buffer, self.loss_terms = loop, buffer, loss_terms
        # max_steps, steps_per_epoch, num_processes, dataset_size (None: a stream), args (the config), resume_at
        self.run = run

    def fields(self, state: Any, window: dict[str, list[float]]) -> dict[str, Any]:
        return {
            **self.loop.state_dict(),
            "max_steps": self.run["max_steps"],
            "num_input_tokens_seen": state.num_input_tokens_seen,
            "total_flos": state.total_flos,
            "log_history": state.log_history,
            "metrics_window": window,
            "entropy_control": self.loss_terms.state_dict(),  # use_adaptive_entropy: coefficient, last entropy
            "rollouts": self.buffer.mid_cycle(self.loop.micro_step),
            "num_processes": self.run["num_processes"],
            "dataset_size": self.run["dataset_size"],
            "config": {k: v for k, v in self.run["args"].to_dict().items() if _jsonable(v)},
        }

    def read(self, checkpoint: str, state: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        config, now = state["config"], self.run["args"].to_dict()
        differ = [
            f"{k}: checkpoint {config.get(k)!r}, now {now.get(k)!r}"
            for k in RUN_GEOMETRY
            if config.get(k) != now.get(k)
        ]
        for key, label in (("num_processes", "number of processes"), ("dataset_size", "train_dataset rows")):
            if state[key] != self.run[key]:
                differ.append(f"{label}: checkpoint {state[key]}, now {self.run[key]}")
        if differ:
            raise files.CheckpointMismatchError(
                f"Cannot resume exactly from {checkpoint}: " + "; ".join(differ) + ". Resume with "
                "the run's original settings, or start a new run (another output_dir)."
            )
        return checkpoint, state

    def restore(self, value: tuple[str, dict[str, Any]]) -> Resumed:
        checkpoint, state = value
        self.loop.load_state_dict(state)
        self.loop.data_position = self.run["resume_at"](self.loop.data_position)
        files.apply(checkpoint, files.STATE, lambda: self.loss_terms.load_state_dict(state.get("entropy_control")))
        trainer_state = {
            "global_step": state["global_step"],
            "num_input_tokens_seen": state["num_input_tokens_seen"],
            "total_flos": float(state.get("total_flos", 0.0)),
            "log_history": state["log_history"],
            "epoch": state["global_step"] / self.run["steps_per_epoch"],
        }
        return Resumed(trainer_state, state["metrics_window"])


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


def of(
    args: ResolvedConfig,
    accelerator: Any,
    model: Any,
    optimizer: Any,
    lr_scheduler: Any,
    rollouts: tuple[Any, Any],
    extra: Sequence[Any],
) -> list[StateComponent]:
    """A run's components, from its parts once built (after `prepare`): its optimization, its buffered rollouts
    (`rollouts`: the buffer and the loop position it is read at), the `extra` ones (the mixed reference, in-flight
    rounds), its generators last."""
    # where saved tensors go: accelerate numbers CPU processes' devices ("cpu:1"), which torch.load rejects
    device = "cpu" if accelerator.device.type == "cpu" else accelerator.device
    own_file = not sharding.is_sharded(model) and not zero.in_use(accelerator)  # else the shards hold it
    writer = strategy.writer(args, accelerator)
    optimization = Optimization(optimizer, lr_scheduler, accelerator.scaler, own_file, writer, device)
    buffered = BufferedRollouts(*rollouts, accelerator.process_index, device)
    return [optimization, buffered, *extra, GeneratorStates(accelerator.process_index)]


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
