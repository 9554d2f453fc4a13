"""The small run most tests train: its config, datasets, a generation from a trainer, parameter snapshots, a
checkpoint's trainer state, the logged rows a resumed or repeated run reproduces, and a callback whose state
checkpoints keep."""

from __future__ import annotations

import json
import os

from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from grpo import GRPOConfig

BASE = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=8,
    max_steps=1,
    logging_steps=1,
    learning_rate=1e-2,
    disable_tqdm=True,
    save_strategy="no",
    bf16=False,
    seed=0,
)


def cfg(tmp_path, **kw):
    """The small run most tests train (BASE: 8 completions of at most 8 tokens, one step)."""
    return GRPOConfig(**{**BASE, "output_dir": str(tmp_path / "out"), **kw})


def chat_dataset(n=8, tasks=True):
    """n conversational prompts "Solve i+1" with their solution; with `tasks`, a "task" column too (math for even
    rows, format for odd ones: what multi-task rewards read)."""
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"Solve {i}+1"}],
                "solution": str(i + 1),
                **({"task": "math" if i % 2 == 0 else "format"} if tasks else {}),
            }
            for i in range(n)
        ]
    )


def text_dataset(n=8):
    return Dataset.from_list([{"prompt": f"Solve the equation x = {i}.", "ground_truth": str(i)} for i in range(n)])


def generate(trainer, rows):
    """Completions of dataset rows `rows` (tool rounds included) from the trainer's current policy: its producer,
    synced to the policy's weights first, as a training round does."""
    trainer.parts.producer.sync(trainer.unwrapped_model, trainer.policy_version)
    return trainer.parts.producer.generate(rows)


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def weights(trainer):
    """The trainer's policy's parameters (unwrapped), copied."""
    return {n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters()}


def state_of(path):
    """A checkpoint's trainer_state.json."""
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


SESSION = ("train_loss",)  # the summary row's loss averages the steps this process trained (the HF Trainer's)


def timed(key):
    return "timing/" in key or key.endswith(("runtime", "_per_second", "step_time"))


def untimed(rows, resumed=False):
    """The logged rows without what measures time (the one thing a run may not reproduce) and, for a resumed run,
    the session's own summary."""
    return [{k: v for k, v in row.items() if not timed(k) and not (resumed and k in SESSION)} for row in rows]


class Counting(TrainerCallback, ExportableState):
    """Counts steps; its state is exported to checkpoints (as transformers' stateful callbacks are)."""

    def __init__(self, start=0):
        self.start, self.steps = start, start

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def state(self):
        return {"args": {"start": self.start}, "attributes": {"steps": self.steps}}
