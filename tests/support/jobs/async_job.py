"""An 8-step asynchronous training run (async_generation, max_staleness 2, a checkpoint every step) for the
kill-and-resume tests, run as its own process:

    python async_job.py OUT MODEL_DIR RESUME

It prints STARTED when training begins (the test then waits a random time and kills it). A reward function that
takes a few milliseconds keeps the producer busy so that kills land during generations, weight snapshots, steps and
checkpoint writes alike. At the end the final parameters go to OUT/final_params.pt and the log history to
OUT/log_history.json."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback

import grpo.checkpoint as ckpt
from grpo import GRPOConfig, GRPOTrainer


def slow_length_reward(completions, trainer_state, **kwargs):
    time.sleep(0.1)
    return [len(c[0]["content"]) / 8.0 + 0.01 * trainer_state.global_step for c in completions]


class Started(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        print("STARTED", flush=True)


def main() -> None:
    out, model, resume = sys.argv[1], sys.argv[2], bool(int(sys.argv[3]))
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Solve {i}+1"}]} for i in range(8)])
    args = GRPOConfig(
        output_dir=out,
        max_steps=8,
        save_steps=1,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        logging_steps=1,
        disable_tqdm=True,
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        async_generation=True,
        max_staleness=2,
        run_report=False,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=slow_length_reward, train_dataset=data, args=args, callbacks=[Started()]
    )
    trainer.train(resume_from_checkpoint=resume or None)
    torch.save(ckpt.model_state(trainer.model, trainer.accelerator), os.path.join(out, "final_params.pt"))
    with open(os.path.join(out, "log_history.json"), "w") as f:
        json.dump(trainer.state.log_history, f)
    sys.exit(0)


if __name__ == "__main__":
    main()
