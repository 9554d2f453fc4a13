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

from grpo.checkpoint import files


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


def of_run(buffer: Any, loop: Any, accelerator: Any, extra: Sequence[Any] = ()) -> list[Any]:
    """A run's components: its buffered rollouts, the `extra` ones (the mixed reference), its generators last."""
    # where saved tensors go: accelerate numbers CPU processes' devices ("cpu:1"), which torch.load rejects
    device = "cpu" if accelerator.device.type == "cpu" else accelerator.device
    rank = accelerator.process_index
    return [BufferedRollouts(buffer, loop, rank, device), *extra, GeneratorStates(rank)]
