"""Effect of restore_callback_states_from_checkpoint: a stateful callback resumes with its saved state."""

from __future__ import annotations

from support.field_effects import Setting, effect
from support.rewards import length_reward
from support.runs import chat_dataset


@effect("restore_callback_states_from_checkpoint", True)
def _(s: Setting) -> None:
    from grpo import GRPOTrainer
    from support.runs import Counting

    resumed = GRPOTrainer(
        model=s.model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(tasks=False),
        args=s.config(max_steps=2, save_strategy="no", output_dir=str(s.tmp_path / "b")),
        callbacks=[Counting(start=100)],
    )
    first = s.trainer(max_steps=2, save_strategy="steps", save_steps=1)
    first.add_callback(Counting())
    first.train()  # its checkpoint-1 holds the counter at 1
    resumed.train(resume_from_checkpoint=str(s.tmp_path / "out" / "checkpoint-1"))
    assert (resumed.callback_handler.callbacks[0].start, resumed.callback_handler.callbacks[0].steps) == (0, 2)
