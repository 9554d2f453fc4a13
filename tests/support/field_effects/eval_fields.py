"""Effects of the evaluation fields: on the tiny model, with a 4-prompt eval dataset."""

from __future__ import annotations

import torch

from support.field_effects import Setting, effect
from support.rewards import length_reward
from support.runs import chat_dataset


def _trainer(s: Setting, **more):
    from grpo import GRPOTrainer

    return GRPOTrainer(
        model=s.model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(tasks=False),
        eval_dataset=chat_dataset(4, tasks=False),
        args=s.config(**more),
    )


def _eval_steps(trainer) -> list[int]:
    return [row["step"] for row in trainer.state.log_history if "eval_reward" in row]


@effect("eval_strategy", "steps")
def _(s: Setting) -> None:
    trainer = _trainer(s, max_steps=2)
    trainer.train()
    assert _eval_steps(trainer) == [1, 2]  # every logging_steps (1) when eval_steps is None


@effect("eval_steps", 2)
def _(s: Setting) -> None:
    trainer = _trainer(s, max_steps=4, eval_strategy="steps")
    trainer.train()
    assert _eval_steps(trainer) == [2, 4]


@effect("eval_delay", 2)
def _(s: Setting) -> None:
    trainer = _trainer(s, max_steps=3, eval_strategy="steps", eval_steps=1)
    trainer.train()
    assert _eval_steps(trainer) == [2, 3]


@effect("eval_on_start", True)
def _(s: Setting) -> None:
    trainer = _trainer(s, max_steps=1)
    trainer.train()
    assert _eval_steps(trainer) == [0]


@effect("per_device_eval_batch_size", 4)
def _(s: Setting) -> None:
    trainer = _trainer(s)
    sizes = []
    inner = trainer.engine.generate
    trainer.engine.generate = lambda requests: sizes.append(sum(r.num_samples for r in requests)) or inner(requests)
    trainer.evaluate()
    assert sizes == [4] * 4  # one prompt's 4 completions per batch (the default 8 takes two prompts)


@effect("num_generations_eval", 2)
def _(s: Setting) -> None:
    metrics = _trainer(s, per_device_eval_batch_size=4).evaluate()
    assert "eval_pass@2" in metrics and "eval_pass@4" not in metrics


@effect("eval_greedy", True)
def _(s: Setting) -> None:
    trainer = _trainer(s)
    torch.manual_seed(1)
    first = trainer.evaluate()
    torch.manual_seed(2)
    second = trainer.evaluate()
    assert "eval_pass@1" in first and first["eval_reward"] == second["eval_reward"]


@effect("eval_pass_threshold", 0.0)
def _(s: Setting) -> None:
    metrics = _trainer(s).evaluate()
    assert metrics["eval_pass@4"] == 1.0  # every completion reaches a length reward of 0 (the default 1.0: 8 letters)
